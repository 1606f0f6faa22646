//! Which type each tensor of a model gets when a file is quantized: llama-quantize's
//! choices (upstream 34af94cd9) for the file types `astra quantize` writes — which
//! tensors are quantized at all, the mixtures' per-tensor rules (more bits for some
//! layers' attention values and feed-forward outputs, the output matrix in Q6_K,
//! eight-expert models' attention in Q8_0), and the fallbacks for rows a type's block
//! does not divide.

use astra_gguf::GgmlType;

/// A file type: the type most tensors get, and the rules for the rest.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_0,
    Q4_K_M,
    Q5_K_M,
    Q6_K,
}

/// Names as llama-quantize takes them (`Q4_K` and `Q5_K` are its aliases of the `_M`
/// mixtures), with llama.cpp's `general.file_type` ids.
const FILE_TYPES: [(&str, FileType, u32); 14] = [
    ("F32", FileType::F32, 0),
    ("F16", FileType::F16, 1),
    ("BF16", FileType::BF16, 32),
    ("Q4_0", FileType::Q4_0, 2),
    ("Q4_1", FileType::Q4_1, 3),
    ("Q5_0", FileType::Q5_0, 8),
    ("Q5_1", FileType::Q5_1, 9),
    ("Q8_0", FileType::Q8_0, 7),
    ("Q2_0", FileType::Q2_0, 41),
    ("Q4_K_M", FileType::Q4_K_M, 15),
    ("Q4_K", FileType::Q4_K_M, 15),
    ("Q5_K_M", FileType::Q5_K_M, 17),
    ("Q5_K", FileType::Q5_K_M, 17),
    ("Q6_K", FileType::Q6_K, 18),
];

impl FileType {
    /// The file type named `name` (any case), `None` for one not written here.
    pub fn from_name(name: &str) -> Option<FileType> {
        FILE_TYPES
            .iter()
            .find(|(n, ..)| n.eq_ignore_ascii_case(name))
            .map(|&(_, t, _)| t)
    }

    /// Every name [`FileType::from_name`] takes.
    pub fn names() -> impl Iterator<Item = &'static str> {
        FILE_TYPES.iter().map(|(n, ..)| *n)
    }

    pub fn name(self) -> &'static str {
        FILE_TYPES.iter().find(|e| e.1 == self).expect("listed").0
    }

    /// llama.cpp's `general.file_type` value.
    pub fn id(self) -> u32 {
        FILE_TYPES.iter().find(|e| e.1 == self).expect("listed").2
    }

    /// The type of the tensors no rule singles out.
    pub fn default_type(self) -> GgmlType {
        match self {
            FileType::F32 => GgmlType::F32,
            FileType::F16 => GgmlType::F16,
            FileType::BF16 => GgmlType::BF16,
            FileType::Q4_0 => GgmlType::Q4_0,
            FileType::Q4_1 => GgmlType::Q4_1,
            FileType::Q5_0 => GgmlType::Q5_0,
            FileType::Q5_1 => GgmlType::Q5_1,
            FileType::Q8_0 => GgmlType::Q8_0,
            FileType::Q2_0 => GgmlType::Q2_0,
            FileType::Q4_K_M => GgmlType::Q4_K,
            FileType::Q5_K_M => GgmlType::Q5_K,
            FileType::Q6_K => GgmlType::Q6_K,
        }
    }
}

/// What the rules read of the model's metadata.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// `general.architecture`.
    pub arch: String,
    /// `{arch}.block_count`.
    pub n_layer: usize,
    /// `{arch}.expert_count` (0 for a dense model).
    pub n_expert: usize,
    /// `{arch}.attention.head_count` and `head_count_kv` (0 where absent).
    pub n_head: usize,
    pub n_head_kv: usize,
}

impl ModelInfo {
    /// Whether llama.cpp counts the model as a 70B one (80 layers of Llama with grouped
    /// query attention, or of Qwen2), whose attention values get more bits.
    fn is_70b(&self) -> bool {
        self.n_layer == 80
            && match self.arch.as_str() {
                "llama" => self.n_head != self.n_head_kv,
                "qwen2" => true,
                _ => false,
            }
    }
}

/// A tensor as the rules see it.
#[derive(Clone, Copy, Debug)]
pub struct TensorDesc<'a> {
    pub name: &'a str,
    /// ggml order: `dims[0]` is a row's length.
    pub dims: &'a [u64],
    pub ty: GgmlType,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RecipeError(pub String);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    AttnQ,
    AttnV,
    AttnK,
    AttnQkv,
    AttnKvB,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Output,
    Other,
}

fn category(name: &str) -> Category {
    use Category::*;
    let has = |s: &str| name.contains(s);
    if name == "output.weight" {
        Output
    } else if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        TokenEmbd
    } else if has("attn_qkv.weight") {
        AttnQkv
    } else if has("attn_kv_b.weight") {
        AttnKvB
    } else if has("attn_v.weight") {
        AttnV
    } else if has("attn_k.weight") {
        AttnK
    } else if has("attn_q.weight") {
        AttnQ
    } else if has("attn_output.weight") {
        AttnOutput
    } else if has("ffn_up") {
        FfnUp
    } else if has("ffn_gate") {
        FfnGate
    } else if has("ffn_down") {
        FfnDown
    } else {
        Other
    }
}

fn is_attn_v(c: Category) -> bool {
    matches!(c, Category::AttnV | Category::AttnQkv | Category::AttnKvB)
}

/// Parts of names llama-quantize never quantizes (norms, routers, small or positional
/// tensors of some architectures).
const KEPT: [&str; 33] = [
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
];

/// Whether the tensor is quantized at all: a matrix (or stack of them) of weights that
/// no exception names.
fn allows_quantization(t: &TensorDesc<'_>) -> bool {
    // ggml counts dimensions up to the last one above 1.
    let n_dims = t.dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1);
    n_dims >= 2
        && t.name.ends_with("weight")
        && !KEPT.iter().any(|k| t.name.contains(k))
        && !["position_embd.weight", "token_types.weight"].contains(&t.name)
        && !t.name.contains("a.rvq.codebook")
        && !t.name.contains("mm.a.code_embd")
}

/// Layers get more bits at both ends and every third in between.
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64) % 3 == 2
}

/// The counters llama-quantize keeps as it goes through the tensors.
struct State<'m> {
    model: &'m ModelInfo,
    tied: bool,
    n_attention_wv: usize,
    i_attention_wv: usize,
    i_ffn_down: usize,
}

impl State<'_> {
    /// The layer of a feed-forward tensor: counted for dense models, read from the name
    /// where experts make the count unreliable.
    fn layer(&self, counter: usize, name: &str) -> Result<usize, RecipeError> {
        if self.model.n_expert <= 1 {
            return Ok(counter);
        }
        let parsed = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok());
        match parsed {
            Some(i) if i < self.model.n_layer => Ok(i),
            Some(i) => Err(RecipeError(format!(
                "tensor {name}: layer {i} is outside the model's {}",
                self.model.n_layer
            ))),
            None => Err(RecipeError(format!("tensor {name}: no layer number"))),
        }
    }

    /// The mixture's choice for a quantized tensor whose default is `ty`.
    fn rule(
        &mut self,
        t: &TensorDesc<'_>,
        ftype: FileType,
        ty: GgmlType,
    ) -> Result<GgmlType, RecipeError> {
        use Category::*;
        use GgmlType as G;
        let cat = category(t.name);
        let (n_expert, falcon) = (self.model.n_expert, self.model.arch == "falcon");
        let mixture = matches!(ftype, FileType::Q4_K_M | FileType::Q5_K_M);
        let mut new = ty;
        if cat == Output || (self.tied && cat == TokenEmbd) {
            if falcon || !t.dims[0].is_multiple_of(ty.block_elems()) {
                new = G::Q8_0;
            } else if ty != G::Q8_0 {
                new = G::Q6_K;
            }
        } else if cat == TokenEmbd {
            if ftype == FileType::Q2_0 {
                new = G::Q4_K;
            }
        } else if is_attn_v(cat) {
            if mixture && use_more_bits(self.i_attention_wv, self.n_attention_wv) {
                new = G::Q6_K;
            }
            // 70B models share each value matrix among eight heads: it is small.
            if self.model.is_70b() && matches!(new, G::Q3_K | G::Q4_K) {
                new = G::Q5_K;
            }
            if n_expert == 8 {
                new = G::Q8_0;
            }
            self.i_attention_wv += 1;
        } else if cat == AttnK {
            if n_expert == 8 {
                new = G::Q8_0;
            }
        } else if cat == FfnDown {
            let (i, n) = (self.layer(self.i_ffn_down, t.name)?, self.model.n_layer);
            match ftype {
                FileType::Q4_K_M if falcon => {
                    new = if i < n / 16 {
                        G::Q6_K
                    } else if use_more_bits(i, n) {
                        G::Q5_K
                    } else {
                        G::Q4_K
                    };
                }
                FileType::Q4_K_M | FileType::Q5_K_M if use_more_bits(i, n) => new = G::Q6_K,
                _ => {}
            }
            self.i_ffn_down += 1;
        } else if cat == AttnOutput {
            if !falcon && n_expert == 8 && ftype == FileType::Q4_K_M {
                new = G::Q5_K;
            }
        } else if matches!(cat, FfnGate | FfnUp) {
            // No rule of these file types; the layer must still be readable.
            self.layer(0, t.name)?;
        }
        Ok(new)
    }
}

/// The type a row of `ncols` values can take instead of `ty`, whose block does not
/// divide it.
fn fallback(name: &str, ncols: u64, ty: GgmlType) -> Result<GgmlType, RecipeError> {
    use GgmlType as G;
    if ncols.is_multiple_of(ty.block_elems()) {
        return Ok(ty);
    }
    let instead = match ty {
        G::Q2_0 | G::Q2_K | G::Q3_K => G::Q4_0,
        G::Q4_K => G::Q5_0,
        G::Q5_K => G::Q5_1,
        G::Q6_K => G::Q8_0,
        _ => {
            return Err(RecipeError(format!(
                "tensor {name}: rows of {ncols} values are not a whole number of {ty} blocks \
                 ({} values)",
                ty.block_elems()
            )))
        }
    };
    Ok(if ncols.is_multiple_of(instead.block_elems()) {
        instead
    } else {
        G::F16
    })
}

/// The order llama-quantize goes through tensors named `names` in (and writes them):
/// the tensors outside the layers first, then layer by layer, each group by name.
pub fn llama_order(names: &[&str]) -> Vec<usize> {
    let layer_of = |name: &str| -> i64 {
        name.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(-1)
    };
    let mut order: Vec<usize> = (0..names.len()).collect();
    order.sort_by(|&a, &b| (layer_of(names[a]), names[a]).cmp(&(layer_of(names[b]), names[b])));
    order
}

/// The type of each of `tensors` (in their order) in a file of type `ftype`.
pub fn plan(
    model: &ModelInfo,
    tensors: &[TensorDesc<'_>],
    ftype: FileType,
) -> Result<Vec<GgmlType>, RecipeError> {
    // The counters of the rules follow llama-quantize's order.
    let names: Vec<&str> = tensors.iter().map(|t| t.name).collect();
    let order = llama_order(&names);
    let mut state = State {
        model,
        tied: !tensors.iter().any(|t| t.name == "output.weight"),
        n_attention_wv: tensors
            .iter()
            .filter(|t| is_attn_v(category(t.name)))
            .count(),
        i_attention_wv: 0,
        i_ffn_down: 0,
    };
    let default = ftype.default_type();
    let quantized = !matches!(default, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    let mut out = vec![GgmlType::F32; tensors.len()];
    for i in order {
        let t = &tensors[i];
        if t.dims.is_empty() {
            return Err(RecipeError(format!("tensor {}: no dimensions", t.name)));
        }
        out[i] = if !allows_quantization(t) {
            t.ty
        } else if quantized {
            let ty = state.rule(t, ftype, default)?;
            fallback(t.name, t.dims[0], ty)?
        } else {
            default
        };
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ids_are_llama_cpp_s() {
        assert_eq!(FileType::from_name("q4_k"), Some(FileType::Q4_K_M));
        assert_eq!(FileType::from_name("Q8_0").map(FileType::id), Some(7));
        assert_eq!(FileType::Q2_0.id(), 41);
        assert_eq!(FileType::from_name("IQ2_S"), None);
    }

    /// Llama 3 70B's layer 11 (not one of use_more_bits'): its values in Q5_K, not Q4_K.
    #[test]
    fn seventy_b_values_get_more_bits() {
        let model = |n_head_kv| ModelInfo {
            arch: "llama".into(),
            n_layer: 80,
            n_expert: 0,
            n_head: 64,
            n_head_kv,
        };
        let names: Vec<String> = (0..80).map(|i| format!("blk.{i}.attn_v.weight")).collect();
        let dims = [8192u64, 1024];
        let tensors: Vec<TensorDesc> = names
            .iter()
            .map(|name| TensorDesc {
                name,
                dims: &dims,
                ty: GgmlType::F16,
            })
            .collect();
        let gqa = plan(&model(8), &tensors, FileType::Q4_K_M).unwrap();
        assert_eq!((gqa[11], gqa[0]), (GgmlType::Q5_K, GgmlType::Q6_K));
        // Without grouped-query attention llama.cpp calls it 65B: no bump.
        assert_eq!(
            plan(&model(64), &tensors, FileType::Q4_K_M).unwrap()[11],
            GgmlType::Q4_K
        );
    }

    #[test]
    fn more_bits_at_the_ends_and_every_third() {
        let picked: Vec<usize> = (0..16).filter(|&i| use_more_bits(i, 16)).collect();
        assert_eq!(picked, [0, 1, 4, 7, 10, 13, 14, 15]);
    }

    #[test]
    fn norms_routers_and_vectors_are_kept() {
        let model = ModelInfo {
            arch: "qwen3moe".into(),
            n_layer: 1,
            n_expert: 8,
            n_head: 4,
            n_head_kv: 2,
        };
        let t = |name, dims| TensorDesc {
            name,
            dims,
            ty: GgmlType::F32,
        };
        let tensors = [
            t("blk.0.attn_norm.weight", &[256]),
            t("blk.0.ffn_gate_inp.weight", &[256, 8]),
            t("blk.0.ffn_up_exps.weight", &[256, 512, 8]),
            t("blk.0.attn_q.bias", &[256, 4]),
            t("blk.0.one_row.weight", &[256, 1]),
        ];
        let types = plan(&model, &tensors, FileType::Q8_0).unwrap();
        use GgmlType::*;
        assert_eq!(types, [F32, F32, Q8_0, F32, F32]);
    }

    #[test]
    fn rows_no_block_divides_are_refused_or_fall_back() {
        let model = ModelInfo {
            arch: "llama".into(),
            n_layer: 1,
            n_expert: 0,
            n_head: 4,
            n_head_kv: 2,
        };
        let odd = [TensorDesc {
            name: "blk.0.attn_q.weight",
            dims: &[40, 64],
            ty: GgmlType::F16,
        }];
        let err = plan(&model, &odd, FileType::Q4_0).unwrap_err().0;
        assert!(err.contains("not a whole number of Q4_0 blocks"), "{err}");
        // Q4_K over rows of 96: Q5_0 instead; of 40: F16.
        let k = |cols| {
            let dims = [cols, 64];
            let t = [TensorDesc {
                name: "blk.0.attn_q.weight",
                dims: &dims,
                ty: GgmlType::F16,
            }];
            plan(&model, &t, FileType::Q4_K_M).unwrap()[0]
        };
        assert_eq!(
            (k(96), k(40), k(512)),
            (GgmlType::Q5_0, GgmlType::F16, GgmlType::Q4_K)
        );
    }
}
