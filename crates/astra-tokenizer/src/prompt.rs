//! Incremental prompt encoding: a prompt that grows (message by message, or piece by
//! piece) is re-tokenized only from a point where the result cannot have changed.
//!
//! Why it is exact. A full encode partitions the text at special tokens and tokenizes
//! each plain fragment on its own (fragments after a special token start exactly as a
//! text start does). So if a boundary B of the old partition is still a boundary of the
//! new text's partition, the new ids are the old ids before B followed by the encoding
//! of text[B..] (without BOS). A boundary stays a boundary when the special token that
//! ends at B lies wholly before `old_len - max_special_len`: every special-token match
//! that the change can create or move overlaps the changed bytes, so it starts after
//! that point, and matching is left-to-right per token, so nothing before it moves.
//! The encoder therefore restarts at the end of the last special token that ends at or
//! before `common_prefix - max_special_len` (or at 0).

use crate::partition::Fragment;
use crate::{EncodeOptions, Tokenizer};

pub struct PromptEncoder<'t> {
    tokenizer: &'t Tokenizer,
    opts: EncodeOptions,
    text: String,
    ids: Vec<u32>,
    /// (byte end of a special-token fragment, number of ids up to and including it).
    restart_points: Vec<(usize, usize)>,
    /// Ids reused from the previous encoding by the last update.
    reused: usize,
}

impl<'t> PromptEncoder<'t> {
    pub fn new(tokenizer: &'t Tokenizer, opts: EncodeOptions) -> Self {
        PromptEncoder {
            tokenizer,
            opts,
            text: String::new(),
            ids: Vec::new(),
            restart_points: Vec::new(),
            reused: 0,
        }
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Ids kept from the previous state by the last update (the rest were re-encoded).
    pub fn reused(&self) -> usize {
        self.reused
    }

    /// Appends text.
    pub fn push_str(&mut self, piece: &str) -> &[u32] {
        let mut text = std::mem::take(&mut self.text);
        let keep = text.len();
        text.push_str(piece);
        self.update(text, keep)
    }

    /// Replaces the prompt by `text` (for instance the chat template rendered with one
    /// more message), reusing what the two share.
    pub fn set_text(&mut self, text: &str) -> &[u32] {
        let common = common_prefix(&self.text, text);
        self.update(text.to_owned(), common)
    }

    /// Re-encodes `text`, of which the first `common` bytes equal the old text's.
    fn update(&mut self, text: String, common: usize) -> &[u32] {
        let limit = common.saturating_sub(self.tokenizer.specials.max_len(self.opts.parse_special));
        // The last restart point whose special token ends at or before the limit.
        let k = self
            .restart_points
            .partition_point(|&(end, _)| end <= limit);
        let (byte, id_count) = if k == 0 {
            (0, 0)
        } else {
            self.restart_points[k - 1]
        };
        self.restart_points.truncate(k);
        self.ids.truncate(id_count);
        self.reused = id_count;
        let o = self.opts;
        let (ids, fragments) = self.tokenizer.encode_parts(
            &text[byte..],
            o.parse_special,
            o.add_special && byte == 0,
            o.add_special,
        );
        let base = self.ids.len();
        for (f, start) in fragments {
            if let Fragment::Token { range, .. } = f {
                self.restart_points
                    .push((byte + range.end, base + start + 1));
            }
        }
        self.ids.extend(ids);
        self.text = text;
        &self.ids
    }
}

/// Length in bytes of the longest common prefix that ends on a character boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    let n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    (0..=n).rev().find(|&i| a.is_char_boundary(i)).unwrap_or(0)
}
