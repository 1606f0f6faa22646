//! `astra quantize IN OUT TYPE`: a GGUF file's F32, F16 and BF16 tensors quantized as
//! llama-quantize would (its per-tensor choices, `astra_quant::recipe`; ggml's
//! reference quantizers, `astra_quant::quantize_weights`), one tensor in memory at a
//! time, written through a temporary file.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use astra_gguf::{GgmlType, GgufFile, GgufWriter, TensorSource, Value};
use astra_quant::recipe::{llama_order, plan, FileType, ModelInfo, TensorDesc};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file to quantize (its tensors F32, F16 or BF16).
    input: PathBuf,
    /// Where the quantized file goes.
    output: PathBuf,
    /// The file type: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_0, Q4_K_M (or Q4_K), Q5_K_M (or
    /// Q5_K), Q6_K, F16, BF16, F32.
    #[arg(value_name = "TYPE")]
    ftype: String,
}

/// Rows quantized per parallel task.
const ROWS_PER_TASK: usize = 16;

pub fn run(args: Args) -> Result<()> {
    let Some(ftype) = FileType::from_name(&args.ftype) else {
        let names: Vec<_> = FileType::names().collect();
        bail!("unknown type {:?}: one of {}", args.ftype, names.join(", "));
    };
    let same = |a: &PathBuf, b: &PathBuf| {
        std::fs::canonicalize(a)
            .ok()
            .zip(std::fs::canonicalize(b).ok())
            .is_some_and(|(a, b)| a == b)
    };
    if same(&args.input, &args.output) {
        bail!("the output would overwrite the input");
    }
    let file =
        GgufFile::open(&args.input).with_context(|| format!("reading {}", args.input.display()))?;
    let meta = file.metadata();
    let arch = meta
        .str("general.architecture")
        .unwrap_or_default()
        .to_owned();
    let count = |key: &str| {
        meta.get(&format!("{arch}.{key}"))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    let model = ModelInfo {
        n_layer: count("block_count") as usize,
        n_expert: count("expert_count") as usize,
        n_head: count("attention.head_count") as usize,
        n_head_kv: count("attention.head_count_kv") as usize,
        arch,
    };
    let tensors = file.tensors();
    let descs: Vec<TensorDesc> = tensors
        .iter()
        .map(|t| TensorDesc {
            name: &t.name,
            dims: &t.dims,
            ty: t.ty,
        })
        .collect();
    let types = plan(&model, &descs, ftype)?;
    for (t, &ty) in tensors.iter().zip(&types) {
        if ty != t.ty && !matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            bail!(
                "tensor {} is already quantized ({}): quantize from a file of F32, F16 or BF16 \
                 tensors",
                t.name,
                t.ty
            );
        }
    }

    let mut w = GgufWriter::new();
    // A shard of a split model becomes a whole file of its own, as llama-quantize
    // writes it.
    const SPLIT_KEYS: [&str; 3] = ["split.no", "split.count", "split.tensors.count"];
    for (key, value) in meta.iter().filter(|(k, _)| !SPLIT_KEYS.contains(k)) {
        w.set(key, value.clone());
    }
    w.set("general.quantization_version", Value::U32(2));
    w.set("general.file_type", Value::U32(ftype.id()));
    // llama-quantize's order, so that the file lays out as its files do.
    let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    let order = llama_order(&names);
    let bar = ProgressBar::new(tensors.len() as u64).with_style(
        ProgressStyle::with_template("{msg:40} [{bar:30}] {pos}/{len} tensors")
            .expect("valid template")
            .progress_chars("=> "),
    );
    for &i in &order {
        let (t, ty) = (&tensors[i], types[i]);
        let data = file.tensor_data(t);
        let elems = t.elems();
        let len = ty.bytes_for(elems).context("tensor size")? as usize;
        let bar = bar.clone();
        let source = if ty == t.ty {
            bar.inc(1);
            TensorSource::Bytes(data)
        } else {
            let (name, from, cols) = (t.name.clone(), t.ty, t.dims[0] as usize);
            TensorSource::Made {
                len,
                make: Box::new(move || {
                    bar.set_message(format!("{name} → {ty}"));
                    let out = convert(data, from, ty, cols)
                        .map_err(|e| std::io::Error::other(format!("tensor {name}: {e}")));
                    bar.inc(1);
                    out
                }),
            }
        };
        w.add_tensor(&t.name, &t.dims, ty, source)?;
    }
    w.write_file(&args.output)
        .with_context(|| format!("writing {}", args.output.display()))?;
    bar.finish_and_clear();
    let quantized = types
        .iter()
        .zip(tensors)
        .filter(|(ty, t)| **ty != t.ty)
        .count();
    println!(
        "{}: {} of {} tensors quantized ({}), {:.1} MiB → {:.1} MiB",
        args.output.display(),
        quantized,
        tensors.len(),
        ftype.name(),
        file.len() as f64 / (1 << 20) as f64,
        std::fs::metadata(&args.output).map_or(0, |m| m.len()) as f64 / (1 << 20) as f64
    );
    Ok(())
}

/// Rows of `cols` values in `from` (F32, F16 or BF16) as `to`, in parallel.
fn convert(data: &[u8], from: GgmlType, to: GgmlType, cols: usize) -> Result<Vec<u8>> {
    let in_row = from.bytes_for(cols as u64).context("row size")? as usize;
    if in_row == 0 || data.is_empty() {
        // A tensor of no values (a zero dimension) is no bytes in any type.
        return Ok(Vec::new());
    }
    let chunks: Vec<Vec<u8>> = data
        .par_chunks(in_row * ROWS_PER_TASK)
        .map(|rows| -> Result<Vec<u8>> {
            let mut x = vec![0.0f32; rows.len() / in_row * cols];
            astra_quant::dequantize(from, rows, &mut x)?;
            Ok(astra_quant::quantize_weights(to, &x)?)
        })
        .collect::<Result<_>>()?;
    Ok(chunks.concat())
}
