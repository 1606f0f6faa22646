//! Byte-level BPE (`tokenizer.ggml.model = gpt2`): bytes mapped to printable code
//! points (GPT-2's table), words merged pair by pair in merge-rank order.
//!
//! Merging follows llama.cpp's `llm_tokenizer_bpe_session`: all adjacent pairs with a
//! rank go into a queue ordered by (rank, position); the best pair is merged unless
//! either side has changed since it was queued, and the new neighbours are queued.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::pretokenize::PreTokenizer;
use crate::vocab::Vocab;
use crate::TokenizerError;

/// GPT-2's byte ↔ code point table: printable bytes map to themselves, the rest to
/// U+0100 onwards in byte order.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).expect("Latin-1")
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below U+0200")
        };
    }
    table
}

pub struct Bpe {
    pub pre: PreTokenizer,
    /// Merge rank of each (left id, right id) pair.
    ranks: HashMap<(u32, u32), u32>,
    byte_chars: [char; 256],
    char_bytes: HashMap<char, u8>,
}

/// A symbol of the word being merged: a byte range of the mapped word and its token.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    end: usize,
    id: Option<u32>,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Bpe {
    pub fn new(vocab: &Vocab, pre: PreTokenizer, merges: &[String]) -> Result<Bpe, TokenizerError> {
        let mut ranks = HashMap::with_capacity(merges.len());
        for (rank, merge) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte.
            let split = merge.bytes().skip(1).position(|b| b == b' ').map(|i| i + 1);
            let Some(split) = split else {
                return Err(TokenizerError::Invalid(format!(
                    "merge {rank} {merge:?} has no separating space"
                )));
            };
            let (left, right) = (&merge[..split], &merge[split + 1..]);
            if let (Some(l), Some(r)) = (vocab.id(left), vocab.id(right)) {
                ranks.entry((l, r)).or_insert(rank as u32);
            }
        }
        let byte_chars = byte_to_char_table();
        let char_bytes = byte_chars
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        Ok(Bpe {
            pre,
            ranks,
            byte_chars,
            char_bytes,
        })
    }

    /// Appends the tokens of one text fragment (no special tokens in it).
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        let mut mapped = String::new();
        let mut symbols = Vec::new();
        for range in self.pre.split(text) {
            mapped.clear();
            mapped.extend(text[range].bytes().map(|b| self.byte_chars[b as usize]));
            self.encode_word(vocab, &mapped, &mut symbols, out);
        }
    }

    fn encode_word(
        &self,
        vocab: &Vocab,
        word: &str,
        symbols: &mut Vec<Symbol>,
        out: &mut Vec<u32>,
    ) {
        if self.pre.ignores_merges() {
            if let Some(id) = vocab.id(word) {
                out.push(id);
                return;
            }
        }
        symbols.clear();
        let count = word.chars().count();
        for (i, (start, c)) in word.char_indices().enumerate() {
            let end = start + c.len_utf8();
            symbols.push(Symbol {
                start,
                end,
                id: vocab.id(&word[start..end]),
                prev: i.checked_sub(1),
                next: (i + 1 < count).then_some(i + 1),
            });
        }
        // Queue entries: (rank, left index, left id, right id); the ids tell whether
        // the pair is still what it was when queued.
        let mut queue = BinaryHeap::new();
        let push = |queue: &mut BinaryHeap<Reverse<(u32, usize, u32, u32)>>,
                    symbols: &[Symbol],
                    left: usize| {
            let Some(right) = symbols[left].next else {
                return;
            };
            if let (Some(l), Some(r)) = (symbols[left].id, symbols[right].id) {
                if let Some(&rank) = self.ranks.get(&(l, r)) {
                    queue.push(Reverse((rank, left, l, r)));
                }
            }
        };
        for i in 0..symbols.len() {
            push(&mut queue, symbols, i);
        }
        while let Some(Reverse((_, left, l, r))) = queue.pop() {
            let Some(right) = symbols[left].next else {
                continue;
            };
            if symbols[left].start == symbols[left].end
                || symbols[left].id != Some(l)
                || symbols[right].id != Some(r)
            {
                continue;
            }
            let merged_end = symbols[right].end;
            symbols[left].end = merged_end;
            symbols[left].id = vocab.id(&word[symbols[left].start..merged_end]);
            symbols[left].next = symbols[right].next;
            symbols[right].start = symbols[right].end; // emptied
            symbols[right].id = None;
            if let Some(next) = symbols[left].next {
                symbols[next].prev = Some(left);
            }
            if let Some(prev) = symbols[left].prev {
                push(&mut queue, symbols, prev);
            }
            push(&mut queue, symbols, left);
        }
        let mut i = Some(0);
        while let Some(k) = i.filter(|_| !symbols.is_empty()) {
            let s = symbols[k];
            match s.id {
                Some(id) => out.push(id),
                // A symbol that is no token: each of its bytes, where that byte alone
                // is a token (llama.cpp's fallback; unreachable with a complete vocab).
                None => out.extend(
                    word[s.start..s.end]
                        .bytes()
                        .filter_map(|b| std::str::from_utf8(&[b]).ok().and_then(|t| vocab.id(t))),
                ),
            }
            i = s.next;
        }
    }

    /// The bytes a normal token stands for.
    pub fn token_bytes(&self, text: &str, out: &mut Vec<u8>) {
        for c in text.chars() {
            match self.char_bytes.get(&c) {
                Some(&b) => out.push(b),
                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
    }
}
