//! Attention cases for `astra parity kernels`: several sequences' keys and values
//! stored and attended through a backend's caches, batch after batch (prompt chunks
//! and decode rows mixed), against an f64 reference. Each case's outputs can be saved
//! and compared bit for bit with another build's or another cache layout's
//! (`ASTRA_ATTN`).

use half::f16;

use crate::attention::{KvLayout, KvType};
use crate::backend::{Attend, Backend, SeqRows};
use crate::backend_parity::{attention_layers, distance, Rng};
use crate::config::Config;
use crate::EngineError;

/// KV heads of every case; its query heads are `group` times as many.
const KV_HEADS: usize = 2;

/// One attention case: a head shape, a layer kind and a schedule of batches.
#[derive(Clone, Debug)]
pub struct AttnCase {
    pub head_dim: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// The layer's sliding window, or none for a global layer.
    pub window: Option<usize>,
    /// Long sequences: two of 500–670 positions, so that a decode row spans many
    /// chunks and both windows' rings wrap.
    pub long: bool,
}

impl AttnCase {
    pub fn name(&self) -> String {
        let layer = match self.window {
            Some(w) => format!("window {w}"),
            None => "global".to_owned(),
        };
        let length = if self.long { "long" } else { "short" };
        format!(
            "head {}, {} per KV head, {layer}, {length}",
            self.head_dim, self.group
        )
    }

    /// Rows each of three sequences adds, batch by batch: prompt chunks beside decode
    /// rows, chunks crossing page ends, and (windows of 40 and 100) rings that wrap.
    fn schedule(&self) -> &'static [[usize; 3]] {
        if self.long {
            &[
                [300, 1, 64],
                [300, 1, 1],
                [1, 250, 1],
                [1, 250, 1],
                [1, 1, 1],
                [64, 1, 1],
                [1, 1, 1],
            ]
        } else {
            &[
                [70, 1, 100],
                [1, 64, 1],
                [29, 1, 1],
                [64, 1, 100],
                [1, 1, 1],
                [1, 1, 1],
                [64, 64, 64],
            ]
        }
    }

    fn config(&self) -> Config {
        let (hd, heads, window) = (self.head_dim, KV_HEADS * self.group, self.window);
        attention_layers(hd, heads, KV_HEADS, window, vec![window.is_some()])
    }
}

/// The largest relative L2 distance from the f64 reference (keys and values rounded
/// as the cache stores them) a case may show. What is left is f32 arithmetic: scores
/// of at most 256 products, exponentials, and chunk partials of up to 64 weighted rows
/// merged, each step rounding by about 2⁻²⁴ relative, which comes to the order of
/// 1e-7. The bound leaves room for other summation orders and a GPU's exponentials,
/// and is far below what one misplaced chunk gives.
pub const ATTN_BOUND: f64 = 1e-5;

/// The cases: heads of 64, 128 and 256 elements; one, two and four query heads per KV
/// head; a global layer and windows of 40 and 100; short and long sequences.
pub fn default_cases() -> Vec<AttnCase> {
    let mut cases = Vec::new();
    for long in [false, true] {
        for head_dim in [64, 128, 256] {
            for group in [1, 2, 4] {
                for window in [None, Some(40), Some(100)] {
                    cases.push(AttnCase {
                        head_dim,
                        group,
                        window,
                        long,
                    });
                }
            }
        }
    }
    cases
}

/// A case's result: every batch's outputs in order, and their distance from the
/// reference.
pub struct AttnReport {
    pub rel_l2: f64,
    pub max_abs: f64,
    pub outputs: Vec<f32>,
}

impl AttnReport {
    pub fn passed(&self) -> bool {
        self.rel_l2 <= ATTN_BOUND
    }
}

/// Runs `case` on `be`, its inputs drawn from `seed`.
pub fn run<B: Backend>(be: &B, case: &AttnCase, seed: u64) -> Result<AttnReport, EngineError> {
    let cfg = case.config();
    let schedule = case.schedule();
    let seqs = schedule[0].len();
    let longest: usize = (0..seqs)
        .map(|s| schedule.iter().map(|b| b[s]).sum::<usize>())
        .max()
        .unwrap_or(0);
    let max_batch = schedule.iter().flatten().copied().max().unwrap_or(1);
    // A context past the last chunk's end: the last chunk of a global layer's slots is
    // part of one.
    let layout = KvLayout::new(&cfg, longest + 3, max_batch).of(be.kv_type());
    let round: fn(f32) -> f64 = match be.kv_type() {
        KvType::F16 => |x| f16::from_f32(x).to_f64(),
        KvType::F32 => |x| x as f64,
    };
    let (qd, kd) = (cfg.q_dim(), cfg.kv_dim());
    let scale = 1.0 / (case.head_dim as f32).sqrt();
    let mut rng = Rng(seed);
    let mut caches = (0..seqs)
        .map(|_| be.kv_cache(&layout))
        .collect::<Result<Vec<_>, _>>()?;
    // Each sequence's keys and values so far, as the reference reads them.
    let mut held: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); seqs];
    let mut pos = vec![0usize; seqs];
    let (mut outputs, mut want, mut got) = (Vec::new(), Vec::new(), Vec::new());
    for batch in schedule {
        let rows: usize = batch.iter().sum();
        let (q, k, v) = (rng.vec(rows * qd), rng.vec(rows * kd), rng.vec(rows * kd));
        let mut positions = Vec::with_capacity(rows);
        let mut starts = Vec::with_capacity(seqs);
        for (s, &n) in batch.iter().enumerate() {
            be.kv_reserve(&mut caches[s], pos[s]..pos[s] + n)?;
            starts.push(positions.len());
            positions.extend((pos[s]..pos[s] + n).map(|p| p as u32));
        }
        let ids = be.ids(&positions)?;
        let (qt, kt, vt) = (
            be.tensor_from(&q, qd)?,
            be.tensor_from(&k, kd)?,
            be.tensor_from(&v, kd)?,
        );
        let mut out = be.tensor(rows, qd)?;
        let mut rows_of: Vec<SeqRows<'_, B::KvCache>> = caches
            .iter_mut()
            .zip(batch)
            .enumerate()
            .map(|(s, (kv, &n))| SeqRows {
                kv,
                rows: starts[s]..starts[s] + n,
                pos: pos[s],
            })
            .collect();
        be.kv_store(0, &mut rows_of, &ids, &kt, &vt);
        be.attention(
            Attend {
                layer: 0,
                seqs: &mut rows_of,
                positions: &ids,
                q: &qt,
                scale,
            },
            &mut out,
        );
        let out = be.read(&out)?;
        for (s, &n) in batch.iter().enumerate() {
            for i in starts[s]..starts[s] + n {
                held[s]
                    .0
                    .extend(k[i * kd..(i + 1) * kd].iter().map(|&x| round(x)));
                held[s]
                    .1
                    .extend(v[i * kd..(i + 1) * kd].iter().map(|&x| round(x)));
                // Every decode row, and a sample of a prompt's rows with its last.
                let t = i - starts[s];
                if n > 1 && t % 7 != 0 && t != n - 1 {
                    continue;
                }
                let p = pos[s] + t;
                let first = case.window.map_or(0, |w| (p + 1).saturating_sub(w));
                want.extend(reference(
                    &cfg,
                    &q[i * qd..(i + 1) * qd],
                    &held[s],
                    first..p + 1,
                    scale,
                ));
                got.extend_from_slice(&out[i * qd..(i + 1) * qd]);
            }
            pos[s] += n;
        }
        outputs.extend(out);
    }
    let (rel_l2, max_abs) = distance(&want, &got);
    Ok(AttnReport {
        rel_l2,
        max_abs,
        outputs,
    })
}

/// One query row's attention (every head) in f64 over positions `span` of `held`'s
/// keys and values (`(position, kv_head, head_dim)`), rounded to f32 at the end.
pub(crate) fn reference(
    cfg: &Config,
    q: &[f32],
    (keys, values): &(Vec<f64>, Vec<f64>),
    span: std::ops::Range<usize>,
    scale: f32,
) -> Vec<f32> {
    let (hd, kd, group) = (cfg.head_dim, cfg.kv_dim(), cfg.n_head / cfg.n_head_kv);
    let mut out = vec![0.0f32; cfg.n_head * hd];
    for h in 0..cfg.n_head {
        let (qh, g) = (&q[h * hd..(h + 1) * hd], h / group);
        let scores: Vec<f64> = span
            .clone()
            .map(|p| {
                let k = &keys[p * kd + g * hd..][..hd];
                qh.iter().zip(k).map(|(&a, &b)| a as f64 * b).sum::<f64>() * scale as f64
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
        let mut acc = vec![0.0f64; hd];
        for (p, s) in span.clone().zip(&scores) {
            let w = (s - max).exp() / sum;
            let v = &values[p * kd + g * hd..][..hd];
            acc.iter_mut().zip(v).for_each(|(a, &b)| *a += w * b);
        }
        out[h * hd..(h + 1) * hd]
            .iter_mut()
            .zip(acc)
            .for_each(|(o, a)| *o = a as f32);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::KvStorage;
    use crate::cpu::CpuBackend;

    /// Contiguous and paged caches give the same bits on every case, within the bound
    /// of the f64 reference, with the KV cache in f16 and in f32.
    #[test]
    fn contiguous_and_paged_caches_agree_to_the_bit() {
        let cases = default_cases();
        assert!(cases.len() >= 40);
        let long = |i: usize| i % 13 == 5;
        let chosen: Vec<&AttnCase> = (0..cases.len())
            .filter(|&i| cases[i].long && long(i))
            .map(|i| &cases[i])
            .collect();
        assert!(chosen.len() == 2 && chosen.iter().all(|c| c.window.is_some()));
        for kv in [KvType::F16, KvType::F32] {
            let paged = CpuBackend::with_kv_type(2, kv).with_storage(KvStorage::Paged);
            let contiguous = CpuBackend::with_kv_type(2, kv).with_storage(KvStorage::Contiguous);
            // Every short case, and two long ones with windows, in a debug build's time.
            for (i, case) in cases
                .iter()
                .enumerate()
                .filter(|&(i, c)| !c.long || long(i))
            {
                let a = run(&paged, case, 100 + i as u64).unwrap();
                let b = run(&contiguous, case, 100 + i as u64).unwrap();
                assert!(
                    a.passed(),
                    "{} ({kv:?}): {:.3e} from f64",
                    case.name(),
                    a.rel_l2
                );
                assert_eq!(a.outputs.len(), b.outputs.len());
                assert!(
                    a.outputs
                        .iter()
                        .zip(&b.outputs)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{} ({kv:?}): contiguous and paged differ",
                    case.name()
                );
            }
        }
    }
}
