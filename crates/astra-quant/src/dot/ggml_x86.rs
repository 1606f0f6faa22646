//! ggml's x86 dot products, the ones llama.cpp runs on AVX2 machines without AVX-512,
//! as scalar statements of the same arithmetic, so that a matrix product gives the
//! bits llama.cpp gives there.
//!
//! ggml widens a 32-element block's products into eight float lanes, lane j holding
//! the exact integer sum of elements 4j..4j+4; each lane is a chain of fused
//! multiply-adds of (weight scale × activation scale) and that sum over the blocks, and
//! the lanes are added at the end as `hsum_float_8` adds them. Types with a minimum
//! keep its terms apart: a fused chain of minimum × activation block sum, added last.
//! This differs from astra's own kernels ([`super::scalar`]) only in where the float
//! roundings fall, but a rounding moved can flip an activation's 8-bit rounding in a
//! later layer, and such flips grow: matching llama.cpp's logits closely takes its
//! arithmetic exactly.

use crate::blocks::*;

/// ggml's `hsum_float_8`: the two halves added lane by lane, then lanes 0+2 and 1+3,
/// then those two.
#[inline(always)]
pub fn hsum8(x: [f32; 8]) -> f32 {
    let h = [x[0] + x[4], x[1] + x[5], x[2] + x[6], x[3] + x[7]];
    (h[0] + h[2]) + (h[1] + h[3])
}

#[inline(always)]
fn pairs<'a, W: Block, A: Block>(w: &'a [u8], a: &'a [u8]) -> impl Iterator<Item = (&'a W, &'a A)> {
    as_blocks::<W>(w).iter().zip(as_blocks::<A>(a))
}

/// Eight lane chains over blocks: `d` and the 32 codes of each block (as i32) against
/// the activation quants.
#[inline(always)]
fn lanes(acc: &mut [f32; 8], d: f32, codes: &[i32; 32], qs: &[i8; 32]) {
    for (j, acc) in acc.iter_mut().enumerate() {
        let isum: i32 = (4 * j..4 * j + 4).map(|e| codes[e] * qs[e] as i32).sum();
        *acc = d.mul_add(isum as f32, *acc);
    }
}

/// The 32 codes of a block of nibbles: low nibbles are elements 0..16, high 16..32.
#[inline(always)]
fn nibbles(qs: &[u8; 16]) -> [i32; 32] {
    std::array::from_fn(|e| if e < 16 { (qs[e] & 0xF) as i32 } else { (qs[e - 16] >> 4) as i32 })
}

/// `ggml_vec_dot_q4_1_q8_1` (AVX2).
pub fn dot_q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let (mut acc, mut mins) = ([0.0f32; 8], 0.0f32);
    for (w, a) in pairs::<BlockQ4_1, BlockQ8_1>(w, a) {
        mins = w.m.get().mul_add(a.s.get(), mins);
        lanes(&mut acc, w.d.get() * a.d.get(), &nibbles(&w.qs), &a.qs);
    }
    hsum8(acc) + mins
}

/// `ggml_vec_dot_q8_0_q8_0` (AVX2); llamafile's `tinyBLAS_Q0_AVX`, which takes
/// batches of two or more tokens, computes the same lanes and sums.
pub fn dot_q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (w, a) in pairs::<BlockQ8_0, BlockQ8_0>(w, a) {
        lanes(&mut acc, w.d.get() * a.d.get(), &w.qs.map(|q| q as i32), &a.qs);
    }
    hsum8(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::ActType;
    use crate::GgmlType;

    /// Against astra's scalar reference (itself tested against f64): the same terms,
    /// so they differ only by float association, within f32 rounding of the terms'
    /// magnitudes.
    #[test]
    fn ggml_dots_are_the_reference_dot_product() {
        let mut seed = 0x9E37_79B9u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f32 / u32::MAX as f32) * 2.0 - 1.0
        };
        let n = 4096;
        let w: Vec<f32> = (0..n).map(|_| next()).collect();
        let x: Vec<f32> = (0..n).map(|_| next()).collect();
        let cases: [(GgmlType, fn(&[u8], &[u8]) -> f32, fn(&[u8], &[u8]) -> f32); 2] = [
            (GgmlType::Q4_1, dot_q4_1_q8_1, crate::dot::scalar::dot_q4_1_q8_1),
            (GgmlType::Q8_0, dot_q8_0_q8_0, crate::dot::scalar::dot_q8_0_q8_0),
        ];
        for (ty, dot, reference) in cases {
            let wq = crate::quantize(ty, &w).unwrap();
            let act = ActType::for_weights(ty).unwrap();
            let mut aq = vec![0u8; act.row_bytes(n).unwrap()];
            act.quantize(&x, &mut aq);
            let magnitude: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            let (got, want) = (dot(&wq, &aq), reference(&wq, &aq));
            assert!((got - want).abs() <= 1e-6 * magnitude, "{ty:?}: {got} vs {want}");
            assert_ne!(got, 0.0);
        }
    }

    /// The lane order of `hsum_float_8`, seen where association matters.
    #[test]
    fn hsum8_adds_as_ggml() {
        let big = 1.0e8f32;
        // (x0+x4 + x2+x6) + (x1+x5 + x3+x7): the 1.0s meet each other before the big ones.
        assert_eq!(hsum8([big, 1.0, -big, 1.0, 0.0, 0.0, 0.0, 0.0]), 2.0);
        assert_eq!(hsum8([big, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), big);
    }
}
