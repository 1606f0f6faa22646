//! Perplexity as llama.cpp's `llama-perplexity` computes it: the tokens cut into
//! non-overlapping chunks of `ctx`; in each chunk (its first token replaced by BOS when
//! the model adds one) the logits at positions ctx/2 .. ctx−2 are scored against the
//! next token; PPL = exp(mean NLL), with the standard error of the mean NLL.

use crate::{Backend, EngineError, Model};

#[derive(Clone, Debug, PartialEq)]
pub struct Perplexity {
    pub ppl: f64,
    /// Standard error of the PPL estimate (llama.cpp's `±`).
    pub error: f64,
    pub chunks: usize,
    pub scored: usize,
}

/// ln softmax(logits)[target], in f64, without building the distribution.
fn log_prob(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits[target] as f64 - max - sum.ln()
}

/// Runs the evaluation; `progress` is called after each chunk with (done, total, PPL so far).
pub fn perplexity<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    mut progress: impl FnMut(usize, usize, f64),
) -> Result<Perplexity, EngineError> {
    if ctx < 4 {
        return Err(EngineError::Invalid(format!(
            "perplexity needs a context of at least 4, got {ctx}"
        )));
    }
    let chunks = tokens.len() / ctx;
    if chunks == 0 {
        return Err(EngineError::Invalid(format!(
            "{} tokens is less than one chunk of {ctx}",
            tokens.len()
        )));
    }
    let first = ctx / 2;
    let (mut nll, mut nll2, mut count) = (0.0f64, 0.0f64, 0usize);
    let n_vocab = model.cfg.n_vocab;
    for c in 0..chunks {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if let Some(bos) = bos {
            chunk[0] = bos;
        }
        let mut session = model.session(ctx)?;
        let logits = model.forward(&mut session, &chunk, first)?;
        for (j, row) in logits
            .chunks_exact(n_vocab)
            .take(ctx - 1 - first)
            .enumerate()
        {
            let v = -log_prob(row, chunk[first + j + 1] as usize);
            nll += v;
            nll2 += v * v;
            count += 1;
        }
        progress(c + 1, chunks, (nll / count as f64).exp());
    }
    let mean = nll / count as f64;
    let ppl = mean.exp();
    let var = nll2 / count as f64 - mean * mean;
    let error = if var > 0.0 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    Ok(Perplexity {
        ppl,
        error,
        chunks,
        scored: count,
    })
}
