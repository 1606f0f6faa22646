//! Code point classification for pre-tokenization: llama.cpp's categories (letter,
//! number, whitespace, ...) looked up in its own tables (`unicode_data`).

use crate::unicode_data::{LETTER, NUMBER, RANGES, WHITESPACE};

/// What pre-tokenization needs to know about a code point.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags {
    /// Category bits (`unicode_data::LETTER`, ...); 0 only outside the text.
    pub category: u8,
    pub whitespace: bool,
}

impl Flags {
    pub fn is_letter(self) -> bool {
        self.category & LETTER != 0
    }
    pub fn is_number(self) -> bool {
        self.category & NUMBER != 0
    }
    pub fn is_whitespace(self) -> bool {
        self.whitespace
    }
    /// Whether the code point exists (inside the text being split): llama.cpp's
    /// `flags.as_uint() != 0`.
    pub fn exists(self) -> bool {
        self.category != 0 || self.whitespace
    }
}

/// The flags of `c`.
pub(crate) fn flags(c: char) -> Flags {
    let cp = c as u32;
    let i = RANGES.partition_point(|&(start, _)| start <= cp) - 1;
    Flags {
        category: RANGES[i].1,
        whitespace: WHITESPACE.binary_search(&cp).is_ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_matches_the_unicode_categories() {
        assert!(flags('a').is_letter() && flags('Ж').is_letter() && flags('中').is_letter());
        assert!(flags('7').is_number() && flags('٣').is_number() && flags('²').is_number());
        assert!(
            flags(' ').is_whitespace()
                && flags('\u{3000}').is_whitespace()
                && flags('\n').is_whitespace()
        );
        assert!(!flags('!').is_letter() && !flags('!').is_number() && flags('!').exists());
        assert!(flags('\u{10FFFF}').exists());
    }
}
