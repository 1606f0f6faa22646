//! Choosing the next token from logits: logit bias, repetition penalties, then greedy
//! or top-k → top-p → min-p → temperature → a draw from a seeded generator (llama.cpp's
//! default order). The same seed and inputs give the same tokens on every machine.

use std::collections::HashMap;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 (or less) means greedy.
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: usize,
    /// 1.0 keeps every token.
    pub top_p: f32,
    /// 0.0 keeps every token.
    pub min_p: f32,
    /// 1.0 is off; divides positive logits (multiplies negative ones) of recent tokens.
    pub repeat_penalty: f32,
    /// Subtracted per occurrence of a recent token.
    pub frequency_penalty: f32,
    /// Subtracted once from every recent token.
    pub presence_penalty: f32,
    /// How many of the last tokens the penalties look at.
    pub penalty_last_n: usize,
    /// Added to the logits of these tokens (−∞ bans, as OpenAI's −100).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            penalty_last_n: 64,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplerConfig {
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            ..Self::default()
        }
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, reproducible everywhere.
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_add(0x9e3779b97f4a7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
            z ^ (z >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 bits.
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// Tokens seen so far (prompt and generated), for the penalties.
    history: Vec<u32>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = Rng::new(cfg.seed);
        Sampler {
            cfg,
            rng,
            history: Vec::new(),
        }
    }

    /// Records tokens the penalties should see (the prompt, accepted tokens).
    pub fn accept(&mut self, tokens: &[u32]) {
        self.history.extend_from_slice(tokens);
    }

    /// Picks the next token from `logits` (which it may modify) and records it.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.apply_bias_and_penalties(logits);
        let id = if self.cfg.temperature <= 0.0 {
            argmax(logits)
        } else {
            self.draw(logits)
        };
        self.history.push(id);
        id
    }

    fn apply_bias_and_penalties(&self, logits: &mut [f32]) {
        for &(id, bias) in &self.cfg.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        let c = &self.cfg;
        if c.repeat_penalty == 1.0 && c.frequency_penalty == 0.0 && c.presence_penalty == 0.0 {
            return;
        }
        let recent = &self.history[self.history.len().saturating_sub(c.penalty_last_n)..];
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in recent {
            *counts.entry(t).or_default() += 1;
        }
        // Sorted so that the order of float updates does not depend on hashing.
        let mut counts: Vec<(u32, u32)> = counts.into_iter().collect();
        counts.sort_unstable();
        for (id, n) in counts {
            let Some(l) = logits.get_mut(id as usize) else {
                continue;
            };
            *l = if *l > 0.0 {
                *l / c.repeat_penalty
            } else {
                *l * c.repeat_penalty
            };
            *l -= n as f32 * c.frequency_penalty + c.presence_penalty;
        }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let c = &self.cfg;
        let cand = top_k(logits, if c.top_k == 0 { logits.len() } else { c.top_k });
        let probs = softmax(&cand.iter().map(|c| c.1).collect::<Vec<_>>());
        // top-p: the smallest prefix whose probability reaches p.
        let mut keep = cand.len();
        if c.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= c.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        // min-p: tokens at least min_p times as likely as the best.
        if c.min_p > 0.0 {
            let floor = probs[0] * c.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&p| p >= floor).count().max(1));
        }
        let cand = &cand[..keep.max(1)];
        let scaled: Vec<f32> = cand.iter().map(|c| c.1 / self.cfg.temperature).collect();
        let probs = softmax(&scaled);
        let r = self.rng.uniform();
        let mut acc = 0.0;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[cand.len() - 1].0
    }
}

/// The index of the largest logit (the lowest index on ties; NaNs are passed over, and
/// with nothing else it is 0). The largest value is found over 16 lanes the compiler
/// vectorizes, then the first block holding it, rather than in one pass with a branch
/// per logit (a 262,144-token vocabulary is read at every step).
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let blocks = logits.chunks_exact(LANES);
    let tail = blocks.remainder();
    for block in blocks {
        for (m, &l) in lanes.iter_mut().zip(block) {
            // A NaN compares false and is passed over.
            *m = if l > *m { l } else { *m };
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    let holds = |block: &[f32]| block.iter().fold(false, |any, &l| any | (l == max));
    let first = logits.chunks(LANES).position(holds).unwrap_or(0) * LANES;
    logits[first..]
        .iter()
        .position(|&l| l == max)
        .map_or(0, |i| first + i) as u32
}

/// `l`'s place in [`f32::total_cmp`]'s order as an integer: two keys compare as
/// integers as their floats do by `total_cmp`.
fn total_key(l: f32) -> i32 {
    let b = l.to_bits() as i32;
    b ^ (((b >> 31) as u32) >> 1) as i32
}

/// The `k` (at most all) candidates of the largest logits, best first: by
/// [`f32::total_cmp`] descending, the lower id first on ties — a total order, the same
/// on every machine.
pub fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(logits.len());
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if k == 0 || k > logits.len() / 8 {
        // Many of them: select, then sort.
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if k < cand.len() {
            cand.select_nth_unstable_by(k.max(1) - 1, by_logit);
            cand.truncate(k);
        }
        cand.sort_unstable_by(by_logit);
        return cand;
    }
    // A few: one pass over blocks of the logits keeping the best k seen in a heap, its
    // top the worst of them. Once the heap is full, a block whose largest logit is no
    // better than that worst one is passed over after a vectorized maximum — nearly
    // every block. (Ids rise through the logits, so an equal logit later is worse.)
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    struct Worse(std::cmp::Reverse<i32>, u32);
    const BLOCK: usize = 64;
    let mut heap = std::collections::BinaryHeap::with_capacity(k + 1);
    for (b, block) in logits.chunks(BLOCK).enumerate() {
        if let Some(worst) = heap.peek().filter(|_| heap.len() == k) {
            let Worse(std::cmp::Reverse(floor), _) = *worst;
            if block
                .iter()
                .map(|&l| total_key(l))
                .max()
                .is_some_and(|best| best <= floor)
            {
                continue;
            }
        }
        for (i, &l) in block.iter().enumerate() {
            let entry = Worse(std::cmp::Reverse(total_key(l)), (b * BLOCK + i) as u32);
            if heap.len() < k {
                heap.push(entry);
            } else if heap.peek().is_some_and(|worst| entry < *worst) {
                heap.pop();
                heap.push(entry);
            }
        }
    }
    // Ascending in `Worse` order: the best first.
    heap.into_sorted_vec()
        .into_iter()
        .map(|Worse(_, id)| (id, logits[id as usize]))
        .collect()
}

/// Softmax in f64 (probabilities sum to 1 within rounding).
pub fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let exps: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use proptest::prelude::*;

    /// Logits drawn from a few values (many ties), with infinities and NaNs of both
    /// signs among them.
    fn logits() -> impl Strategy<Value = Vec<f32>> {
        let value = prop_oneof![
            8 => (-4i32..4).prop_map(|v| v as f32 * 0.5),
            1 => Just(f32::INFINITY),
            1 => Just(f32::NEG_INFINITY),
            1 => Just(f32::NAN),
            1 => Just(-f32::NAN),
            1 => Just(-0.0f32),
            4 => any::<f32>(),
        ];
        prop::collection::vec(value, 1..700)
    }

    proptest! {
        /// The heap's top k are a full sort's first k, for every k.
        #[test]
        fn top_k_is_the_sorted_prefix(v in logits(), k in 0usize..80) {
            let mut all: Vec<(u32, f32)> = v.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
            all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let bits = |c: &[(u32, f32)]| c.iter().map(|&(i, l)| (i, l.to_bits())).collect::<Vec<_>>();
            prop_assert_eq!(bits(&top_k(&v, k)), bits(&all[..k.min(v.len())]));
        }

        /// The first index of the largest non-NaN logit (0 when there is none).
        #[test]
        fn argmax_is_the_first_largest(v in logits()) {
            let mut want = None;
            for (i, &l) in v.iter().enumerate() {
                if !l.is_nan() && want.is_none_or(|w: usize| l > v[w]) {
                    want = Some(i);
                }
            }
            prop_assert_eq!(argmax(&v) as usize, want.unwrap_or(0));
        }
    }

    #[test]
    fn greedy_takes_the_largest_and_bias_can_ban_it() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0]), 1);
        let mut s = Sampler::new(SamplerConfig {
            logit_bias: vec![(1, f32::NEG_INFINITY)],
            ..SamplerConfig::greedy()
        });
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0]), 2);
    }

    #[test]
    fn same_seed_same_tokens_and_the_distribution_is_respected() {
        let logits: Vec<f32> = vec![1.0, 2.0, 0.5, 1.5];
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 42,
            ..Default::default()
        };
        let run = |cfg: &SamplerConfig| -> Vec<u32> {
            let mut s = Sampler::new(cfg.clone());
            (0..2000).map(|_| s.sample(&mut logits.clone())).collect()
        };
        let a = run(&cfg);
        assert_eq!(a, run(&cfg));
        assert_ne!(
            a,
            run(&SamplerConfig {
                seed: 43,
                ..cfg.clone()
            })
        );
        let p = softmax(&logits);
        for id in 0..4 {
            let freq = a.iter().filter(|&&t| t == id).count() as f64 / a.len() as f64;
            assert!(
                (freq - p[id as usize]).abs() < 0.04,
                "token {id}: {freq} vs {}",
                p[id as usize]
            );
        }
    }

    #[test]
    fn top_k_top_p_min_p_restrict_the_candidates() {
        let logits = vec![5.0f32, 4.0, 1.0, 0.0, -1.0];
        for (cfg, allowed) in [
            (
                SamplerConfig {
                    top_k: 2,
                    top_p: 1.0,
                    min_p: 0.0,
                    ..Default::default()
                },
                vec![0, 1],
            ),
            (
                SamplerConfig {
                    top_k: 0,
                    top_p: 0.5,
                    min_p: 0.0,
                    ..Default::default()
                },
                vec![0],
            ),
            (
                SamplerConfig {
                    top_k: 0,
                    top_p: 1.0,
                    min_p: 0.3,
                    ..Default::default()
                },
                vec![0, 1],
            ),
        ] {
            let mut s = Sampler::new(SamplerConfig {
                temperature: 1.5,
                ..cfg
            });
            for _ in 0..300 {
                assert!(allowed.contains(&s.sample(&mut logits.clone())));
            }
        }
    }

    #[test]
    fn penalties_lower_recent_tokens() {
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 2.0,
            presence_penalty: 0.5,
            ..SamplerConfig::greedy()
        });
        s.accept(&[0]);
        let mut l = vec![3.0f32, 2.0];
        assert_eq!(s.sample(&mut l), 1, "3.0 / 2 - 0.5 = 1.0 < 2.0");
        assert_eq!(l[0], 1.0);
    }
}
