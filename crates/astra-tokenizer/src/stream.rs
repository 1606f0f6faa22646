//! Streaming detokenization for server streams: bytes in, whole UTF-8 characters out.
//!
//! Invariant: the concatenation of everything emitted (plus [`StreamDecoder::finish`])
//! is the lossy UTF-8 decoding of all bytes pushed. A character split across tokens is
//! held back until it is complete; only bytes that can never become valid UTF-8 are
//! replaced by U+FFFD, each maximal invalid sequence once (as `String::from_utf8_lossy`).

#[derive(Default, Debug)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds bytes and returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"),
                    );
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Ends the stream: whatever is still held back is incomplete, and is replaced.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Whether bytes are held back waiting for the rest of a character.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any bytes, cut anywhere: the stream equals the lossy decoding of the whole.
        #[test]
        fn stream_equals_whole_decoding(bytes in prop::collection::vec(any::<u8>(), 0..64), cuts in prop::collection::vec(0usize..64, 0..8)) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.sort();
            let mut d = StreamDecoder::new();
            let mut out = String::new();
            let mut last = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                out += &d.push(&bytes[last..c]);
                last = c;
            }
            out += &d.finish();
            prop_assert_eq!(out, String::from_utf8_lossy(&bytes).into_owned());
        }
    }

    #[test]
    fn a_split_character_waits_for_its_end() {
        let crab = "🦀".as_bytes();
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(&crab[..1]), "");
        assert_eq!(d.push(&crab[1..3]), "");
        assert_eq!(d.push(&crab[3..]), "🦀");
        assert!(!d.has_pending());
    }
}
