//! `astra quantize`'s two halves against what llama-quantize wrote: the type chosen for
//! every tensor of a model, and the quantized bytes of sample rows, bit for bit.

use astra_quant::recipe::{plan, FileType, ModelInfo, TensorDesc};
use astra_quant::GgmlType;
use serde_json::Value;

fn cases() -> Vec<(String, Value)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/quantize");
    let mut out: Vec<(String, Value)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (
                name,
                serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(out.len(), 6, "reference files");
    out
}

fn ty(v: &Value) -> GgmlType {
    GgmlType::from_name(v.as_str().unwrap()).unwrap()
}

fn hex(s: &Value) -> Vec<u8> {
    let s = s.as_str().unwrap();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn every_tensor_gets_llama_quantize_s_type() {
    for (file, case) in cases() {
        let m = &case["model"];
        if m.is_null() {
            continue;
        }
        let model = ModelInfo {
            arch: m["arch"].as_str().unwrap().to_owned(),
            n_layer: m["n_layer"].as_u64().unwrap() as usize,
            n_expert: m["n_expert"].as_u64().unwrap() as usize,
            n_head: 0,
            n_head_kv: 0,
        };
        let tensors = case["tensors"].as_array().unwrap();
        let dims: Vec<Vec<u64>> = tensors
            .iter()
            .map(|t| {
                t["dims"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap())
                    .collect()
            })
            .collect();
        let descs: Vec<TensorDesc> = tensors
            .iter()
            .zip(&dims)
            .map(|(t, dims)| TensorDesc {
                name: t["name"].as_str().unwrap(),
                dims,
                ty: ty(&t["from"]),
            })
            .collect();
        let ftype = FileType::from_name(case["file_type"].as_str().unwrap()).unwrap();
        let got = plan(&model, &descs, ftype).unwrap();
        let mut kinds = std::collections::BTreeSet::new();
        for (t, got) in tensors.iter().zip(got) {
            assert_eq!(got, ty(&t["to"]), "{file}: {}", t["name"]);
            kinds.insert(got);
        }
        assert!(kinds.len() >= 2, "{file}: a mixture of types");
    }
}

#[test]
fn rows_quantize_to_llama_quantize_s_bytes() {
    let mut types = std::collections::BTreeSet::new();
    for (file, case) in cases() {
        for r in case["rows"].as_array().unwrap() {
            let (from, to) = (ty(&r["from"]), ty(&r["to"]));
            let input = hex(&r["input"]);
            let mut x = vec![0.0f32; r["cols"].as_u64().unwrap() as usize];
            astra_quant::dequantize(from, &input, &mut x).unwrap();
            let got = astra_quant::quantize_weights(to, &x).unwrap();
            assert!(
                got == hex(&r["output"]),
                "{file}: {} row {} as {to}",
                r["tensor"],
                r["row"]
            );
            types.insert(to);
        }
    }
    use GgmlType::*;
    let want = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_0, Q4_K, Q5_K, Q6_K];
    assert!(want.iter().all(|t| types.contains(t)), "{types:?}");
}
