//! llama.cpp's GBNF grammars rewritten in llguidance's Lark dialect: rules, string
//! literals, character classes, `.`, grouping, alternation and the repetition
//! operators (`*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`), with `root` as the start rule.

use crate::GrammarError;

/// The Lark form of a GBNF grammar; an error names the first thing that does not
/// convert.
pub fn gbnf_to_lark(src: &str) -> Result<String, GrammarError> {
    let mut p = Gbnf {
        s: src.as_bytes(),
        at: 0,
        out: String::new(),
        names: Vec::new(),
    };
    p.grammar()?;
    if !p.names.iter().any(|(gbnf, _)| gbnf == "root") {
        return Err(err("the GBNF grammar has no 'root' rule"));
    }
    Ok(format!("start: {}\n{}", lark_name("root"), p.out))
}

fn err(msg: impl Into<String>) -> GrammarError {
    GrammarError::Compile(msg.into())
}

/// GBNF names allow `-` and capitals; Lark rule names are lower case with `_`.
/// A prefix keeps them apart from Lark's own names (`start`).
fn lark_name(gbnf: &str) -> String {
    let mut s = String::from("g_");
    for c in gbnf.chars() {
        match c {
            '-' => s.push('_'),
            '_' => s.push_str("__"),
            c if c.is_ascii_uppercase() => {
                s.push_str("_u");
                s.push(c.to_ascii_lowercase());
            }
            c => s.push(c),
        }
    }
    s
}

struct Gbnf<'a> {
    s: &'a [u8],
    at: usize,
    out: String,
    /// Rules defined: GBNF name and Lark name.
    names: Vec<(String, String)>,
}

impl Gbnf<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }

    /// Skips blanks and comments; newlines too when `newlines`.
    fn blank(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' | b'\r' => self.at += 1,
                b'\n' if newlines => self.at += 1,
                b'#' => {
                    while self.peek().is_some_and(|c| c != b'\n') {
                        self.at += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.at;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        {
            self.at += 1;
        }
        (self.at > start).then(|| String::from_utf8_lossy(&self.s[start..self.at]).into_owned())
    }

    fn grammar(&mut self) -> Result<(), GrammarError> {
        loop {
            self.blank(true);
            if self.peek().is_none() {
                return Ok(());
            }
            let name = self
                .name()
                .ok_or_else(|| err(format!("GBNF: a rule name expected at byte {}", self.at)))?;
            self.blank(false);
            if !self.s[self.at..].starts_with(b"::=") {
                return Err(err(format!("GBNF: '::=' expected after rule '{name}'")));
            }
            self.at += 3;
            let lark = lark_name(&name);
            if self.names.iter().any(|(g, _)| *g == name) {
                return Err(err(format!("GBNF: rule '{name}' is defined twice")));
            }
            self.names.push((name, lark.clone()));
            let body = self.alternatives(0)?;
            self.out.push_str(&format!("{lark}: {body}\n"));
        }
    }

    /// `seq | seq | ...`; inside parentheses (`depth` > 0) newlines do not end it.
    fn alternatives(&mut self, depth: usize) -> Result<String, GrammarError> {
        let mut alts = vec![self.sequence(depth)?];
        loop {
            self.blank(depth > 0);
            if self.peek() == Some(b'|') {
                self.at += 1;
                alts.push(self.sequence(depth)?);
            } else {
                return Ok(alts.join(" | "));
            }
        }
    }

    fn sequence(&mut self, depth: usize) -> Result<String, GrammarError> {
        let mut items: Vec<String> = Vec::new();
        loop {
            self.blank(depth > 0);
            // A line break outside parentheses continues the rule only when the next
            // line is not a new rule (`name ::=`) and continues with `|`, handled above.
            if depth == 0 && self.peek() == Some(b'\n') {
                let save = self.at;
                self.blank(true);
                if self.peek() == Some(b'|') || self.starts_item() && !self.at_rule_start() {
                    continue;
                }
                self.at = save;
                break;
            }
            if !self.starts_item() {
                break;
            }
            let mut item = self.primary(depth)?;
            self.blank(false);
            match self.peek() {
                Some(op @ (b'*' | b'+' | b'?')) => {
                    self.at += 1;
                    item.push(op as char);
                }
                Some(b'{') => item.push_str(&self.braces()?),
                _ => {}
            }
            items.push(item);
        }
        if items.is_empty() {
            return Ok("\"\"".into());
        }
        Ok(items.join(" "))
    }

    fn starts_item(&self) -> bool {
        matches!(self.peek(), Some(c) if c == b'"' || c == b'[' || c == b'(' || c == b'.' || c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
    }

    fn at_rule_start(&self) -> bool {
        let mut i = self.at;
        while self
            .s
            .get(i)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'_')
        {
            i += 1;
        }
        while matches!(self.s.get(i), Some(b' ' | b'\t')) {
            i += 1;
        }
        self.s[i..].starts_with(b"::=")
    }

    fn primary(&mut self, depth: usize) -> Result<String, GrammarError> {
        match self.peek() {
            Some(b'"') => {
                self.at += 1;
                let mut text = String::new();
                loop {
                    match self.peek() {
                        None => return Err(err("GBNF: an unterminated string literal")),
                        Some(b'"') => {
                            self.at += 1;
                            break;
                        }
                        Some(b'\\') => text.push(self.escape()?),
                        Some(_) => text.push(self.utf8_char()?),
                    }
                }
                Ok(serde_json::to_string(&text).expect("strings serialize"))
            }
            Some(b'[') => {
                self.at += 1;
                let mut class = String::from("[");
                if self.peek() == Some(b'^') {
                    self.at += 1;
                    class.push('^');
                }
                loop {
                    match self.peek() {
                        None => return Err(err("GBNF: an unterminated character class")),
                        Some(b']') => {
                            self.at += 1;
                            break;
                        }
                        Some(b'-') => {
                            self.at += 1;
                            class.push('-');
                        }
                        Some(b'\\') => push_class_char(&mut class, self.escape()?),
                        Some(_) => {
                            let c = self.utf8_char()?;
                            push_class_char(&mut class, c)
                        }
                    }
                }
                class.push(']');
                Ok(format!("/{class}/"))
            }
            Some(b'.') => {
                self.at += 1;
                Ok("/(?s:.)/".into())
            }
            Some(b'(') => {
                self.at += 1;
                let inner = self.alternatives(depth + 1)?;
                self.blank(true);
                if self.peek() != Some(b')') {
                    return Err(err("GBNF: ')' expected"));
                }
                self.at += 1;
                Ok(format!("({inner})"))
            }
            _ => {
                let name = self
                    .name()
                    .ok_or_else(|| err(format!("GBNF: unexpected input at byte {}", self.at)))?;
                Ok(lark_name(&name))
            }
        }
    }

    fn braces(&mut self) -> Result<String, GrammarError> {
        let start = self.at;
        while self.peek().is_some_and(|c| c != b'}') {
            self.at += 1;
        }
        if self.peek().is_none() {
            return Err(err("GBNF: an unterminated '{'"));
        }
        self.at += 1;
        let inner: String = String::from_utf8_lossy(&self.s[start + 1..self.at - 1])
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        let ok = !inner.is_empty()
            && inner.split(',').count() <= 2
            && inner.split(',').next().is_some_and(|m| !m.is_empty())
            && inner
                .split(',')
                .all(|n| n.is_empty() || n.bytes().all(|b| b.is_ascii_digit()));
        if !ok {
            return Err(err(format!("GBNF: a bad repetition '{{{inner}}}'")));
        }
        Ok(format!("{{{inner}}}"))
    }

    fn utf8_char(&mut self) -> Result<char, GrammarError> {
        let rest = std::str::from_utf8(&self.s[self.at..self.s.len().min(self.at + 4)])
            .or_else(|e| std::str::from_utf8(&self.s[self.at..self.at + e.valid_up_to()]))
            .map_err(|_| err("GBNF: invalid UTF-8"))?;
        let c = rest
            .chars()
            .next()
            .ok_or_else(|| err("GBNF: invalid UTF-8"))?;
        self.at += c.len_utf8();
        Ok(c)
    }

    /// A backslash escape: `\n \r \t \\ \" \[ \] \- \/`, `\xHH`, `\uHHHH`, `\UHHHHHHHH`.
    fn escape(&mut self) -> Result<char, GrammarError> {
        self.at += 1;
        let c = self
            .peek()
            .ok_or_else(|| err("GBNF: a dangling backslash"))?;
        self.at += 1;
        let hex = |p: &mut Self, n: usize| -> Result<char, GrammarError> {
            let digits =
                p.s.get(p.at..p.at + n)
                    .and_then(|d| std::str::from_utf8(d).ok())
                    .and_then(|d| u32::from_str_radix(d, 16).ok())
                    .and_then(char::from_u32)
                    .ok_or_else(|| err("GBNF: a bad hexadecimal escape"))?;
            p.at += n;
            Ok(digits)
        };
        Ok(match c {
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'x' => hex(self, 2)?,
            b'u' => hex(self, 4)?,
            b'U' => hex(self, 8)?,
            b'\\' | b'"' | b'[' | b']' | b'-' | b'/' | b'^' => c as char,
            other => return Err(err(format!("GBNF: unknown escape '\\{}'", other as char))),
        })
    }
}

/// A character inside a regex class, escaped where the regex syntax gives it a meaning.
fn push_class_char(class: &mut String, c: char) {
    match c {
        '\\' | ']' | '[' | '^' | '-' | '&' | '~' | '/' => {
            class.push('\\');
            class.push(c);
        }
        '\n' => class.push_str("\\n"),
        '\r' => class.push_str("\\r"),
        '\t' => class.push_str("\\t"),
        c if c.is_control() => class.push_str(&format!("\\x{{{:x}}}", c as u32)),
        c => class.push(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_literals_classes_and_repetition() {
        let g = r#"
# a list of names
root ::= "[" item ("," item){0,3} "]"   # up to four
item ::= [a-zA-Z_-]+ | "\"" [^"\\]* "\""
"#;
        let lark = gbnf_to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: g_root\n\
             g_root: \"[\" g_item (\",\" g_item){0,3} \"]\"\n\
             g_item: /[a-zA-Z_-]/+ | \"\\\"\" /[^\"\\\\]/* \"\\\"\"\n"
        );
    }

    #[test]
    fn continued_lines_and_errors() {
        let g = "root ::= a\n  | b\na ::= \"x\"\nb ::= (\n  \"y\" |\n  \"z\" )";
        let lark = gbnf_to_lark(g).unwrap();
        assert!(lark.contains("g_root: g_a | g_b\n"), "{lark}");
        assert!(lark.contains("g_b: (\"y\" | \"z\")\n"), "{lark}");
        for bad in [
            "item ::= \"x\"",
            "root ::= \"x",
            "root ::= [a-z",
            "root := \"x\"",
            "root ::= x{a}",
            "root ::= \"a\"\nroot ::= \"b\"",
        ] {
            assert!(gbnf_to_lark(bad).is_err(), "{bad}");
        }
    }
}
