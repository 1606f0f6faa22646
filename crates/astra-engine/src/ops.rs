//! Row operations of the transformer on f32 activations: RMSNorm, RoPE, activation
//! functions, residual adds. Each works on one token's row, so a token gets the same
//! arithmetic whatever batch it is in.

/// `out = x / √(mean(x²) + eps) · w`, the sum of squares in f64 (as ggml's rms_norm).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * w;
    }
}

/// RMSNorm in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (v, &w) in x.iter_mut().zip(w) {
        *v = *v * scale * w;
    }
}

/// Rotary position embedding of one head at position `pos`, on its first `dims`
/// values: adjacent pairs (Llama) or the two halves (NeoX). The angle of pair i is
/// pos · base^(−2i/dims), built by repeated multiplication as ggml builds it.
pub fn rope(head: &mut [f32], pos: usize, dims: usize, base: f32, neox: bool) {
    let theta_scale = base.powf(-2.0 / dims as f32);
    let mut theta = pos as f32;
    for i in 0..dims / 2 {
        let (sin, cos) = theta.sin_cos();
        let (a, b) = if neox { (i, i + dims / 2) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * cos - x1 * sin;
        head[b] = x0 * sin + x1 * cos;
        theta *= theta_scale;
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (as ggml's gelu).
pub fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
}

pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Σ a·b in eight lanes (lane l takes elements l, l+8, …, each a separate multiply and
/// add), reduced pairwise, then the tail: one fixed order, computed with AVX where the
/// CPU has it and by the scalar reference otherwise, with the same bits either way.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present.
        return unsafe { simd::dot(a, b) };
    }
    dot_scalar(a, b)
}

fn reduce_lanes(lanes: [f32; 8]) -> f32 {
    ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
}

/// The reference for [`dot`].
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            lanes[l] += a[8 * c + l] * b[8 * c + l];
        }
    }
    let mut tail = 0.0;
    for i in 8 * chunks..a.len() {
        tail += a[i] * b[i];
    }
    reduce_lanes(lanes) + tail
}

/// `acc += w · v`, element by element (a multiply, then an add).
#[inline]
pub fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present.
        return unsafe { simd::axpy(acc, w, v) };
    }
    axpy_scalar(acc, w, v)
}

/// The reference for [`axpy`].
pub fn axpy_scalar(acc: &mut [f32], w: f32, v: &[f32]) {
    for (a, &x) in acc.iter_mut().zip(v) {
        *a += w * x;
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let chunks = n / 8;
        let mut acc = _mm256_setzero_ps();
        for c in 0..chunks {
            let x = _mm256_loadu_ps(a.as_ptr().add(8 * c));
            let y = _mm256_loadu_ps(b.as_ptr().add(8 * c));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut tail = 0.0;
        for i in 8 * chunks..n {
            tail += a[i] * b[i];
        }
        super::reduce_lanes(lanes) + tail
    }

    #[target_feature(enable = "avx")]
    pub unsafe fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
        let n = acc.len().min(v.len());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            let a = _mm256_loadu_ps(acc.as_ptr().add(i));
            let x = _mm256_loadu_ps(v.as_ptr().add(i));
            _mm256_storeu_ps(acc.as_mut_ptr().add(i), _mm256_add_ps(a, _mm256_mul_ps(wv, x)));
            i += 8;
        }
        for j in i..n {
            acc[j] += w * v[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_against_f64() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 7.0).collect();
        let w: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 / 64.0).collect();
        let mut out = vec![0.0; 64];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 64.0;
        for i in 0..64 {
            let want = x[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
            assert!((out[i] as f64 - want).abs() < 1e-5 * want.abs().max(1.0));
        }
    }

    #[test]
    fn rope_rotates_by_the_angle() {
        for neox in [false, true] {
            let mut h = vec![1.0f32, 0.0, 0.5, 0.25];
            rope(&mut h, 3, 4, 10000.0, neox);
            let (a, b) = if neox { (0, 2) } else { (0, 1) };
            let (x0, x1) = if neox { (1.0f64, 0.5) } else { (1.0, 0.0) };
            let t = 3.0f64;
            assert!((h[a] as f64 - (x0 * t.cos() - x1 * t.sin())).abs() < 1e-6);
            assert!((h[b] as f64 - (x0 * t.sin() + x1 * t.cos())).abs() < 1e-6);
            // Norm is preserved.
            let n: f32 = h.iter().map(|v| v * v).sum();
            assert!((n - (1.0 + 0.25 + 0.0625)).abs() < 1e-5);
        }
    }

    /// The AVX forms of dot and axpy give the scalar reference's bits.
    #[test]
    fn simd_dot_and_axpy_equal_the_scalar_reference() {
        let a: Vec<f32> = (0..259).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect();
        let b: Vec<f32> = (0..259).map(|i| ((i * 53 % 97) as f32 - 48.0) / 7.0).collect();
        for n in [0, 5, 8, 64, 256, 259] {
            assert_eq!(dot(&a[..n], &b[..n]).to_bits(), dot_scalar(&a[..n], &b[..n]).to_bits(), "n = {n}");
            let (mut x, mut y) = (a[..n].to_vec(), a[..n].to_vec());
            axpy(&mut x, 0.37, &b[..n]);
            axpy_scalar(&mut y, 0.37, &b[..n]);
            assert_eq!(x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), y.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn activations_against_f64() {
        for x in [-6.0f32, -1.0, -0.1, 0.0, 0.3, 2.0, 8.0] {
            let xd = x as f64;
            let g = 0.5 * xd * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd.powi(3))).tanh());
            assert!((gelu(x) as f64 - g).abs() < 1e-6, "gelu({x})");
            assert!((silu(x) as f64 - xd / (1.0 + (-xd).exp())).abs() < 1e-6, "silu({x})");
        }
    }
}
