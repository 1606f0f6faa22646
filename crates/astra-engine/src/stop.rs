//! Stop strings over streamed text: text is released only once it cannot be the start
//! of a stop string, so a stop string split across tokens is still caught and never
//! shown.

#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released (it may begin a stop string).
    held: String,
    /// The stop string found, once one is.
    matched: Option<String>,
}

/// What pushing text gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text safe to show; generation continues.
    Continue(String),
    /// A stop string was found: the text before it; generation ends.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.push_split(text).0
    }

    /// As [`StopMatcher::push`]; on a stop, also returns the text received after the
    /// stop string (empty otherwise).
    pub fn push_split(&mut self, text: &str) -> (StopOutcome, String) {
        self.held.push_str(text);
        // The earliest match; at equal starts, the longest stop string.
        let found = self
            .stops
            .iter()
            .filter_map(|s| {
                self.held
                    .find(s.as_str())
                    .map(|at| (at, usize::MAX - s.len()))
            })
            .min();
        if let Some((at, inv_len)) = found {
            let before = self.held[..at].to_owned();
            let len = usize::MAX - inv_len;
            let after = self.held[at + len..].to_owned();
            self.matched = Some(self.held[at..at + len].to_owned());
            self.held.clear();
            return (StopOutcome::Stopped(before), after);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&n| s.is_char_boundary(n))
                    .map(move |n| &s[..n])
            })
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let release = self.held.len() - keep;
        let out = self.held[..release].to_owned();
        self.held.drain(..release);
        (StopOutcome::Continue(out), String::new())
    }

    /// The end of generation for another reason: whatever is held is released.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_string_split_across_pieces_is_caught_and_hidden() {
        let mut m = StopMatcher::new(vec!["</answer>".into(), "\n\n".into()]);
        assert_eq!(
            m.push("The answer is 4"),
            StopOutcome::Continue("The answer is 4".into())
        );
        assert_eq!(m.push("2</ans"), StopOutcome::Continue("2".into()));
        assert_eq!(m.push("wer> trailing"), StopOutcome::Stopped(String::new()));
        assert_eq!(m.matched(), Some("</answer>"));
    }

    #[test]
    fn held_text_that_does_not_stop_is_released() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("ab ST"), StopOutcome::Continue("ab ".into()));
        assert_eq!(m.push("AY"), StopOutcome::Continue("STAY".into()));
        assert_eq!(m.push("x S"), StopOutcome::Continue("x ".into()));
        assert_eq!(m.finish(), "S");
    }

    #[test]
    fn the_text_after_a_split_marker_is_kept() {
        let mut m = StopMatcher::new(vec!["</think>".into()]);
        assert_eq!(
            m.push_split("plan: a, b</thi"),
            (StopOutcome::Continue("plan: a, b".into()), String::new())
        );
        assert_eq!(
            m.push_split("nk>\n\nThe answer"),
            (StopOutcome::Stopped(String::new()), "\n\nThe answer".into())
        );
    }
}
