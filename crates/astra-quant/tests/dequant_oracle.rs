//! Dequantization against ggml's reference values: real blocks from both models and
//! random blocks, for every type SPEC requires that has reference data.

use astra_quant::{dequantize, GgmlType};
use serde_json::Value;

const TYPES: [&str; 17] = [
    "BF16", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_S", "IQ4_NL", "Q2_0", "Q2_K", "Q3_K", "Q4_0",
    "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0",
];

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Distance in units in the last place between two finite f32 of the same sign (or
/// zero); u32::MAX when they differ in sign or finiteness.
fn ulps(a: f32, b: f32) -> u32 {
    if a == b {
        return 0;
    }
    if !a.is_finite() || !b.is_finite() || a.is_sign_negative() != b.is_sign_negative() {
        return u32::MAX;
    }
    a.to_bits().abs_diff(b.to_bits())
}

#[test]
fn dequantization_matches_ggml() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/dequant");
    let mut summary = Vec::new();
    for name in TYPES {
        let text = std::fs::read_to_string(format!("{dir}/{name}.json")).unwrap();
        let data: Value = serde_json::from_str(&text).unwrap();
        let ty = GgmlType::from_name(name).unwrap();
        assert_eq!(
            data["ggml_type_id"].as_u64().unwrap() as u32,
            ty.id(),
            "{name}"
        );
        assert_eq!(
            data["block_bytes"].as_u64().unwrap(),
            ty.block_bytes(),
            "{name}"
        );
        assert_eq!(
            data["block_elems"].as_u64().unwrap(),
            ty.block_elems(),
            "{name}"
        );
        let (mut values, mut off_by_one, mut real) = (0, 0, 0);
        for case in data["cases"].as_array().unwrap() {
            let bytes = hex(case["hex"].as_str().unwrap());
            let want: Vec<f32> = case["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            let mut got = vec![0.0f32; want.len()];
            dequantize(ty, &bytes, &mut got).unwrap();
            let source = case["source"].as_str().unwrap();
            real += source.starts_with("real:") as usize;
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let d = ulps(g, w);
                assert!(
                    d <= 1,
                    "{name} {source} value {i}: got {g:e}, ggml {w:e} ({d} ulp)"
                );
                off_by_one += (d == 1) as usize;
                values += 1;
            }
        }
        summary.push(format!(
            "{name}: {values} values ({real} real blocks), {off_by_one} at 1 ulp"
        ));
    }
    eprintln!("{}", summary.join("\n"));
}

/// F16 and Q8_K have no reference file: F16 against the IEEE conversion of every bit
/// pattern, Q8_K against its definition d · q.
#[test]
fn f16_and_q8k_dequantize_by_definition() {
    let bytes: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
    let mut got = vec![0.0f32; 65536];
    dequantize(GgmlType::F16, &bytes, &mut got).unwrap();
    for (b, g) in (0..=u16::MAX).zip(&got) {
        let want = half::f16::from_bits(b).to_f32();
        assert!(
            want.to_bits() == g.to_bits() || (want.is_nan() && g.is_nan()),
            "f16 {b:#06x}"
        );
    }
    let x: Vec<f32> = (0..512)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let q = astra_quant::quantize(GgmlType::Q8_K, &x).unwrap();
    let mut y = vec![0.0f32; 512];
    dequantize(GgmlType::Q8_K, &q, &mut y).unwrap();
    for (block, (xs, ys)) in q
        .chunks_exact(292)
        .zip(x.chunks_exact(256).zip(y.chunks_exact(256)))
    {
        let d = f32::from_le_bytes(block[..4].try_into().unwrap());
        for (k, (&xv, &yv)) in xs.iter().zip(ys).enumerate() {
            assert_eq!(yv, d * (block[4 + k] as i8) as f32);
            assert!(
                (xv - yv).abs() <= d.abs() * 0.5 + 1e-6,
                "quantization error beyond half a step"
            );
        }
    }
}
