//! Cutting special tokens out of text before tokenization (llama.cpp's
//! `tokenizer_st_partition`).
//!
//! Candidates are the control, unknown and user-defined tokens, longest text first
//! (ties by id). For each candidate in that order, every plain-text fragment is split
//! at the candidate's non-overlapping occurrences, left to right. Control and unknown
//! tokens take part only when special parsing is on; user-defined ones always.

use std::ops::Range;

use aho_corasick::AhoCorasick;

use crate::vocab::{TokenType, Vocab};

/// A piece of the partitioned text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fragment {
    /// Plain text to tokenize: a byte range of the input.
    Text(Range<usize>),
    /// A special token found in the text at `range`.
    Token { id: u32, range: Range<usize> },
}

impl Fragment {
    pub fn range(&self) -> Range<usize> {
        match self {
            Fragment::Text(r) | Fragment::Token { range: r, .. } => r.clone(),
        }
    }
}

pub(crate) struct Specials {
    /// Candidate ids in matching order, with whether they need special parsing.
    order: Vec<(u32, bool)>,
    texts: Vec<String>,
    /// Finds which candidates occur at all, so that only those are split on.
    finder: Option<AhoCorasick>,
    /// Longest candidate text in bytes, per special-parsing mode (off, on).
    max_len: [usize; 2],
}

impl Specials {
    pub fn new(vocab: &Vocab) -> Specials {
        let mut order: Vec<(u32, bool)> = (0..vocab.len() as u32)
            .filter_map(|id| match vocab.types[id as usize] {
                TokenType::Control | TokenType::Unknown => Some((id, true)),
                TokenType::UserDefined => Some((id, false)),
                _ => None,
            })
            .filter(|&(id, _)| !vocab.texts[id as usize].is_empty())
            .collect();
        order.sort_by_key(|&(id, _)| (std::cmp::Reverse(vocab.texts[id as usize].len()), id));
        let texts: Vec<String> = order
            .iter()
            .map(|&(id, _)| vocab.texts[id as usize].clone())
            .collect();
        let finder =
            (!texts.is_empty()).then(|| AhoCorasick::new(&texts).expect("special token automaton"));
        let longest = |need_special: bool| {
            order
                .iter()
                .zip(&texts)
                .filter(|((_, s), _)| need_special || !s)
                .map(|(_, t)| t.len())
                .max()
                .unwrap_or(0)
        };
        let max_len = [longest(false), longest(true)];
        Specials {
            order,
            texts,
            finder,
            max_len,
        }
    }

    /// Bytes of the longest special token text that `partition` can match.
    pub fn max_len(&self, parse_special: bool) -> usize {
        self.max_len[usize::from(parse_special)]
    }

    pub fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(0..text.len())];
        let Some(finder) = &self.finder else {
            return fragments;
        };
        let mut present = vec![false; self.order.len()];
        for m in finder.find_overlapping_iter(text) {
            present[m.pattern().as_usize()] = true;
        }
        for (k, &(id, needs_special)) in self.order.iter().enumerate() {
            if !present[k] || (needs_special && !parse_special) {
                continue;
            }
            let needle = self.texts[k].as_str();
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                let Fragment::Text(range) = f else {
                    next.push(f);
                    continue;
                };
                let mut start = range.start;
                let hay = &text[..range.end];
                while let Some(found) = hay[start..].find(needle) {
                    let at = start + found;
                    if at > start {
                        next.push(Fragment::Text(start..at));
                    }
                    next.push(Fragment::Token {
                        id,
                        range: at..at + needle.len(),
                    });
                    start = at + needle.len();
                }
                if start < range.end {
                    next.push(Fragment::Text(start..range.end));
                }
            }
            fragments = next;
        }
        fragments
    }
}
