//! Pre-tokenization for byte-level BPE: splitting text into words before merging.
//!
//! Each splitter is a left-to-right scan that behaves as llama.cpp's hand-written
//! equivalents of the tokenizer regexes (`unicode_regex_split_custom_*`), including
//! their treatment of the end of a piece as "no character" (so `\s+(?!\S)` at the end
//! of a piece takes the whole run). A word is a byte range of the text.

use std::ops::Range;

use crate::unicode::{flags, Flags};

/// The pre-tokenizers named by `tokenizer.ggml.pre`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`.
    Gpt2,
    /// Every number code point on its own (`\p{N}`), then GPT-2 (SmolLM, StarCoder).
    DigitsThenGpt2,
    /// Llama 3: contractions (any case), `[^\r\n\p{L}\p{N}]?\p{L}+`, up to three digits,
    /// punctuation runs with trailing newlines, newline runs, whitespace.
    Llama3,
    /// Qwen 2: as Llama 3 with one digit at a time.
    Qwen2,
}

impl PreTokenizer {
    /// The pre-tokenizer of a `tokenizer.ggml.pre` name, as llama.cpp maps them.
    pub fn from_name(name: &str) -> Option<PreTokenizer> {
        Some(match name {
            "gpt-2" | "mpt" | "olmo" | "jais" | "trillion" => PreTokenizer::Gpt2,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva" => PreTokenizer::DigitsThenGpt2,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => {
                PreTokenizer::Llama3
            }
            "qwen2" | "stablelm2" | "hunyuan" => PreTokenizer::Qwen2,
            _ => return None,
        })
    }

    /// Whether a word that is itself a token skips merging (llama.cpp's
    /// `ignore_merges`, set for Llama 3).
    pub fn ignores_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Splits `text` into words (byte ranges covering the text, in order).
    pub fn split(self, text: &str) -> Vec<Range<usize>> {
        let chars = Chars::new(text);
        let whole: Vec<Range<usize>> = std::iter::once(0..chars.len()).collect();
        let pieces = match self {
            PreTokenizer::DigitsThenGpt2 => split_numbers(&chars, &whole),
            _ => whole,
        };
        let words = match self {
            PreTokenizer::Gpt2 | PreTokenizer::DigitsThenGpt2 => {
                split_words(&chars, &pieces, gpt2_word_end)
            }
            PreTokenizer::Llama3 => {
                split_words(&chars, &pieces, |p, pos| llama3_word_end(p, pos, 3))
            }
            PreTokenizer::Qwen2 => {
                split_words(&chars, &pieces, |p, pos| llama3_word_end(p, pos, 1))
            }
        };
        words.into_iter().map(|r| chars.byte_range(r)).collect()
    }
}

/// The code points of a text with their byte offsets.
struct Chars {
    chars: Vec<char>,
    /// Byte offset of each code point, plus the text length at the end.
    offsets: Vec<usize>,
}

impl Chars {
    fn new(text: &str) -> Chars {
        let mut chars = Vec::with_capacity(text.len());
        let mut offsets = Vec::with_capacity(text.len() + 1);
        for (i, c) in text.char_indices() {
            chars.push(c);
            offsets.push(i);
        }
        offsets.push(text.len());
        Chars { chars, offsets }
    }

    fn len(&self) -> usize {
        self.chars.len()
    }

    fn byte_range(&self, r: Range<usize>) -> Range<usize> {
        self.offsets[r.start]..self.offsets[r.end]
    }
}

/// A view of one piece: code points outside it read as "nothing" (llama.cpp's
/// OUT_OF_RANGE), which is what makes end-of-piece lookaheads fail.
struct Piece<'a> {
    chars: &'a [char],
    start: usize,
    end: usize,
}

impl Piece<'_> {
    fn get(&self, pos: usize) -> Option<char> {
        (self.start <= pos && pos < self.end).then(|| self.chars[pos])
    }
    fn flags(&self, pos: usize) -> Flags {
        self.get(pos).map(flags).unwrap_or_default()
    }
}

/// Splits each piece into adjacent words, left to right: `word_end(piece, pos)` gives
/// the end of the word that starts at `pos` (always past it).
fn split_words(
    chars: &Chars,
    pieces: &[Range<usize>],
    word_end: impl Fn(&Piece, usize) -> usize,
) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(chars.len() / 3);
    for piece in pieces {
        let p = Piece {
            chars: &chars.chars,
            start: piece.start,
            end: piece.end,
        };
        let mut pos = p.start;
        while pos < p.end {
            let end = word_end(&p, pos);
            out.push(pos..end);
            pos = end;
        }
    }
    out
}

/// `\p{N}` as an isolating split: every number code point becomes its own piece. As in
/// llama.cpp, non-ASCII whitespace is never a number, and only code points whose
/// category is exactly "number" count.
fn split_numbers(chars: &Chars, pieces: &[Range<usize>]) -> Vec<Range<usize>> {
    let is_number = |c: char| {
        if c.is_ascii() {
            return c.is_ascii_digit();
        }
        let f = flags(c);
        !f.whitespace && f.category == crate::unicode_data::NUMBER
    };
    let mut out = Vec::new();
    for piece in pieces {
        let mut start = piece.start;
        for pos in piece.clone() {
            if is_number(chars.chars[pos]) {
                if pos > start {
                    out.push(start..pos);
                }
                out.push(pos..pos + 1);
                start = pos + 1;
            }
        }
        if start < piece.end {
            out.push(start..piece.end);
        }
    }
    out
}

/// `'s` `'t` `'m` `'d` (length 2) or `'re` `'ve` `'ll` (length 3) at `pos`, letters
/// compared after `fold` (identity for GPT-2, lowercase for Llama 3).
fn contraction(p: &Piece, pos: usize, fold: fn(char) -> char) -> Option<usize> {
    if p.get(pos) != Some('\'') || pos + 1 >= p.end {
        return None;
    }
    let next = fold(p.get(pos + 1)?);
    if matches!(next, 's' | 't' | 'm' | 'd') {
        return Some(2);
    }
    if pos + 2 < p.end {
        let next2 = fold(p.get(pos + 2)?);
        if matches!((next, next2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
            return Some(3);
        }
    }
    None
}

/// Whitespace run at `pos`: (length, end of its last \r or \n if any).
fn whitespace_run(p: &Piece, pos: usize) -> (usize, Option<usize>) {
    let mut n = 0;
    let mut last_newline = None;
    while p.flags(pos + n).is_whitespace() {
        if matches!(p.get(pos + n), Some('\r' | '\n')) {
            last_newline = Some(pos + n + 1);
        }
        n += 1;
    }
    (n, last_newline)
}

/// The end of the GPT-2 word at `pos`.
fn gpt2_word_end(p: &Piece, pos: usize) -> usize {
    if let Some(len) = contraction(p, pos, |c| c) {
        return pos + len;
    }
    let space = p.get(pos) == Some(' ');
    let mut f2 = if space {
        p.flags(pos + 1)
    } else {
        p.flags(pos)
    };
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
    let classes: [fn(Flags) -> bool; 3] = [
        |f| f.is_letter(),
        |f| f.is_number(),
        |f| !(f.is_whitespace() || f.is_letter() || f.is_number()) && f.exists(),
    ];
    if let Some(class) = classes.iter().find(|class| class(f2)) {
        let mut end = pos + usize::from(space);
        while class(f2) {
            end += 1;
            f2 = p.flags(end);
        }
        return end;
    }
    let (n, _) = whitespace_run(p, pos);
    whitespace_word_end(p, pos, n)
}

/// End of the word at `pos` when nothing but whitespace (a run of `n`) can match:
/// `\s+(?!\S)` takes the run but its last space, which joins the next word; at the end
/// of a piece, or for a single space, `\s+` takes it all; anything else matches alone.
fn whitespace_word_end(p: &Piece, pos: usize, n: usize) -> usize {
    if n > 1 && p.get(pos + n).is_some() {
        pos + n - 1
    } else {
        pos + n.max(1)
    }
}

/// The end of the Llama 3 / Qwen 2 word at `pos` (numbers in groups of `max_digits`).
fn llama3_word_end(p: &Piece, pos: usize, max_digits: usize) -> usize {
    let c = p.get(pos);
    let f = p.flags(pos);
    if let Some(len) = contraction(p, pos, |c| c.to_ascii_lowercase()) {
        return pos + len;
    }
    // `[^\r\n\p{L}\p{N}]?\p{L}+`
    if !(matches!(c, Some('\r' | '\n')) || f.is_number())
        && (f.is_letter() || p.flags(pos + 1).is_letter())
    {
        let mut end = pos + 1;
        while p.flags(end).is_letter() {
            end += 1;
        }
        return end;
    }
    // `\p{N}{1,max_digits}`
    if f.is_number() {
        let mut end = pos;
        while end - pos < max_digits && p.flags(end).is_number() {
            end += 1;
        }
        return end;
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*` (llama.cpp tests the first code point's own flags for
    // existence, and the one after a space for the class)
    let mut f2 = if c == Some(' ') { p.flags(pos + 1) } else { f };
    let punct = |f: Flags| !(f.is_whitespace() || f.is_letter() || f.is_number());
    if punct(f2) && f.exists() {
        let mut end = pos + usize::from(c == Some(' '));
        while punct(f2) && f2.exists() {
            end += 1;
            f2 = p.flags(end);
        }
        while matches!(p.get(end), Some('\r' | '\n')) {
            end += 1;
        }
        return end;
    }
    let (n, last_newline) = whitespace_run(p, pos);
    // `\s*[\r\n]+` first, then as GPT-2.
    last_newline.unwrap_or_else(|| whitespace_word_end(p, pos, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreTokenizer, text: &str) -> Vec<&str> {
        pre.split(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn gpt2_splits_as_its_regex() {
        let w = words(PreTokenizer::Gpt2, "Hello world's  end   x\n\n 42!!");
        assert_eq!(
            w,
            ["Hello", " world", "'s", " ", " end", "  ", " x", "\n\n", " 42", "!!"]
        );
        // A trailing run takes every space (nothing follows to take the last one).
        assert_eq!(words(PreTokenizer::Gpt2, "a   "), ["a", "   "]);
    }

    #[test]
    fn smollm_isolates_digits_first() {
        assert_eq!(
            words(PreTokenizer::DigitsThenGpt2, "  42 a1b"),
            ["  ", "4", "2", " a", "1", "b"]
        );
    }

    #[test]
    fn llama3_groups_three_digits_and_keeps_newlines_with_punctuation() {
        assert_eq!(
            words(PreTokenizer::Llama3, "12345 DON'T x.\n\nok"),
            ["123", "45", " DON", "'T", " x", ".\n\n", "ok"]
        );
        assert_eq!(words(PreTokenizer::Qwen2, "123"), ["1", "2", "3"]);
    }
}
