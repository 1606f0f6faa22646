//! SentencePiece-style tokenization (`tokenizer.ggml.model = llama`): spaces become ▁,
//! characters merge pairwise by the score of the token they form (highest first,
//! leftmost on ties), and characters that end up in no token fall back to byte tokens
//! `<0xXX>`. This follows llama.cpp's `llm_tokenizer_spm_session`.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::vocab::Vocab;

/// The space marker.
pub const SPACE: char = '\u{2581}';

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A queued pair: the score of the token it forms, its left symbol and byte size.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then(Reverse(self.left).cmp(&Reverse(other.left)))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Appends the tokens of `text` (already with ▁ for spaces) to `out`.
pub fn encode(vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
    let count = text.chars().count();
    let mut symbols: Vec<Symbol> = text
        .char_indices()
        .enumerate()
        .map(|(i, (start, c))| Symbol {
            start,
            len: c.len_utf8(),
            prev: i.checked_sub(1),
            next: (i + 1 < count).then_some(i + 1),
        })
        .collect();
    let mut queue = BinaryHeap::new();
    let try_add = |queue: &mut BinaryHeap<Bigram>,
                   symbols: &[Symbol],
                   left: Option<usize>,
                   right: Option<usize>| {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let (l, r) = (symbols[left], symbols[right]);
        let piece = &text[l.start..l.start + l.len + r.len];
        if let Some(id) = vocab.id(piece) {
            let score = vocab.scores.get(id as usize).copied().unwrap_or(0.0);
            queue.push(Bigram {
                score,
                left,
                right,
                size: piece.len(),
            });
        }
    };
    for i in 1..symbols.len() {
        try_add(&mut queue, &symbols, Some(i - 1), Some(i));
    }
    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        // Stale when either side has been merged away or grown since.
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if let Some(next) = r.next {
            symbols[next].prev = Some(b.left);
        }
        try_add(&mut queue, &symbols, symbols[b.left].prev, Some(b.left));
        try_add(&mut queue, &symbols, Some(b.left), symbols[b.left].next);
    }
    let mut i = (!symbols.is_empty()).then_some(0);
    while let Some(k) = i {
        let s = symbols[k];
        let piece = &text[s.start..s.start + s.len];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            None => out.extend(piece.bytes().map(|b| byte_token(vocab, b))),
        }
        i = s.next;
    }
}

/// The `<0xXX>` token of a byte (the unknown token, or 0, if the vocabulary has none).
pub fn byte_token(vocab: &Vocab, b: u8) -> u32 {
    vocab
        .id(&format!("<0x{b:02X}>"))
        .or_else(|| {
            vocab
                .texts
                .iter()
                .position(|t| t == "<unk>")
                .map(|i| i as u32)
        })
        .unwrap_or(0)
}

/// The byte of a `<0xXX>` token text.
pub fn token_byte(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}
