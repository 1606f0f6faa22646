//! One file per architecture: each reads its hyperparameters and tensors and writes its
//! forward pass from the shared blocks of [`blocks`]. Nothing outside this module asks
//! which architecture a model is; the rest of the engine sees a [`Config`] (what the KV
//! cache needs to know) and [`Weights`] (a forward pass over a batch).

mod blocks;
mod gemma3;
mod llama;
mod mixtral;
mod qwen2;
mod qwen3;
mod qwen3moe;

use std::sync::Arc;

use astra_gguf::{GgufFile, Metadata};

use crate::backend::{Backend, SeqRows};
use crate::config::Config;
use crate::weights::Loader;
use crate::EngineError;

pub(crate) use blocks::Activations;
use blocks::{Block, MoeBlock};

/// The architectures this engine runs (GGUF's `general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama family (SmolLM2, Llama 2/3, Mistral): [`llama`]; with experts, Mixtral:
    /// [`mixtral`].
    Llama,
    /// Gemma 3: [`gemma3`].
    Gemma3,
    /// Qwen2 and Qwen2.5: [`qwen2`].
    Qwen2,
    /// Qwen3, dense: [`qwen3`].
    Qwen3,
    /// Qwen3 with mixture-of-experts feed-forwards: [`qwen3moe`].
    Qwen3Moe,
}

impl Arch {
    const ALL: [Arch; 5] = [
        Arch::Llama,
        Arch::Gemma3,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
    ];

    /// The name GGUF metadata gives the architecture, and the prefix of its keys.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    pub fn from_name(name: &str) -> Result<Arch, EngineError> {
        Arch::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| {
                let known: Vec<_> = Arch::ALL.iter().map(|a| a.name()).collect();
                EngineError::Unsupported(format!(
                    "architecture {name:?} (supported: {})",
                    known.join(", ")
                ))
            })
    }
}

/// The hyperparameters of the model `md` describes: the keys every architecture has,
/// then its architecture's own reading of the rest.
pub(crate) fn config(md: &Metadata) -> Result<Config, EngineError> {
    let arch = Arch::from_name(md.str("general.architecture")?)?;
    let mut cfg = Config::common(md, arch)?;
    match arch {
        Arch::Llama => cfg.moe = mixtral::experts(md)?,
        Arch::Qwen2 | Arch::Qwen3 => {}
        Arch::Gemma3 => gemma3::hparams(md, &mut cfg)?,
        Arch::Qwen3Moe => qwen3moe::hparams(md, &mut cfg)?,
    }
    Ok(cfg)
}

/// A model's weights on a backend: the embeddings and output head every architecture
/// has, and its own layers.
pub(crate) struct Weights<B: Backend> {
    pub token_embd: B::Matrix,     // (n_vocab, n_embd)
    pub output_norm: B::Vector,    // (n_embd)
    pub output: Option<B::Matrix>, // (n_vocab, n_embd); `None` when tied to token_embd
    layers: Layers<B>,
}

enum Layers<B: Backend> {
    Llama(Vec<llama::Layer<B>>),
    Mixtral(Vec<mixtral::Layer<B>>),
    Gemma3(Vec<gemma3::Layer<B>>),
    Qwen2(Vec<qwen2::Layer<B>>),
    Qwen3(Vec<qwen3::Layer<B>>),
    Qwen3Moe(Vec<qwen3moe::Layer<B>>),
}

impl<B: Backend> Weights<B> {
    /// Locates `cfg`'s tensors in `file` and makes them available to `be`; returns the
    /// weights and the bytes of them read to decode one token (every matrix once, one
    /// embedding row).
    pub fn load(
        be: &B,
        file: &Arc<GgufFile>,
        cfg: &Config,
    ) -> Result<(Weights<B>, usize), EngineError> {
        let l = Loader::new(be, file);
        let e = cfg.n_embd;
        let token_embd = l.embedding("token_embd.weight", cfg.n_vocab, e)?;
        let output = match file.tensor("output.weight") {
            Some(_) => Some(l.matrix("output.weight", cfg.n_vocab, e)?),
            None => None,
        };
        let output_norm = l.vector("output_norm.weight", e)?;
        let blocks =
            |extras| move |l: &Loader<'_, B>, cfg: &Config, i| Block::load(l, cfg, i, extras);
        let moe_blocks =
            |extras| move |l: &Loader<'_, B>, cfg: &Config, i| MoeBlock::load(l, cfg, i, extras);
        let layers = match (cfg.arch, cfg.moe) {
            (Arch::Llama, None) => Layers::Llama(l.layers(cfg, blocks(llama::EXTRAS))?),
            (Arch::Llama, Some(_)) => Layers::Mixtral(l.layers(cfg, moe_blocks(llama::EXTRAS))?),
            (Arch::Gemma3, _) => Layers::Gemma3(l.layers(cfg, blocks(gemma3::EXTRAS))?),
            (Arch::Qwen2, _) => Layers::Qwen2(l.layers(cfg, blocks(qwen2::EXTRAS))?),
            (Arch::Qwen3, _) => Layers::Qwen3(l.layers(cfg, blocks(qwen3::EXTRAS))?),
            (Arch::Qwen3Moe, _) => Layers::Qwen3Moe(l.layers(cfg, moe_blocks(qwen3::EXTRAS))?),
        };
        let bytes = l.bytes_per_token(output.is_none());
        let w = Weights {
            token_embd,
            output_norm,
            output,
            layers,
        };
        Ok((w, bytes))
    }

    /// The output projection (the embedding matrix when tied).
    pub fn output(&self) -> &B::Matrix {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// The embeddings of `p.tokens` through every layer, into `p.acts.x`.
    pub fn forward(&self, be: &B, cfg: &Config, p: Pass<'_, '_, B>) -> Result<(), EngineError> {
        let e = &self.token_embd;
        match &self.layers {
            Layers::Llama(layers) => llama::forward(be, cfg, e, layers, p),
            Layers::Mixtral(layers) => mixtral::forward(be, cfg, e, layers, p),
            Layers::Gemma3(layers) => gemma3::forward(be, cfg, e, layers, p),
            Layers::Qwen2(layers) => qwen2::forward(be, cfg, e, layers, p),
            Layers::Qwen3(layers) => qwen3::forward(be, cfg, e, layers, p),
            Layers::Qwen3Moe(layers) => qwen3moe::forward(be, cfg, e, layers, p),
        }
    }
}

/// Where in the forward pass [`crate::Model::trace`] read the residual stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The scaled token embeddings, before the first layer.
    Embedding,
    /// Layer `n`'s residual after its attention block.
    Attention(usize),
    /// Layer `n`'s output: the residual after its feed-forward block.
    Layer(usize),
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stage::Embedding => write!(f, "embedding"),
            Stage::Attention(l) => write!(f, "layer {l} attention"),
            Stage::Layer(l) => write!(f, "layer {l}"),
        }
    }
}

/// What [`crate::Model::trace`] shows the residual stream to.
pub(crate) type Probe<'a, B> = dyn FnMut(Stage, &<B as Backend>::Tensor) + 'a;

/// One batch's forward pass: its buffers, its tokens and their positions, which rows
/// belong to which sequence's cache, and a probe to show the residual stream to.
pub(crate) struct Pass<'a, 's, B: Backend> {
    pub acts: &'a mut Activations<B>,
    pub tokens: &'a B::Ids,
    pub positions: &'a B::Ids,
    pub seqs: &'a mut [SeqRows<'s, B::KvCache>],
    /// Shown the residual stream `x` at each [`Stage`] ([`crate::Model::trace`]).
    pub probe: Option<&'a mut Probe<'a, B>>,
}

impl<B: Backend> Pass<'_, '_, B> {
    /// Shows the residual stream at `stage` to the probe, where there is one.
    fn show(&mut self, stage: Stage) {
        if let Some(p) = self.probe.as_mut() {
            p(stage, &self.acts.x)
        }
    }
}
