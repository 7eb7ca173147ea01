//! A BERT-style encoder with a token-level head, laid out as BERT's checkpoints
//! (`embeddings.*`, `encoder.layer.N.attention.self.query`, ..., `cls.predictions.*`), so
//! parameter counts line up with BERT of the same sizes (the decoder is not tied to the word
//! embeddings, since they may live on different pipeline stages).
//!
//! Modules: `embeddings`, one per `encoder.layer.N`, `cls` (transform and decoder to the vocabulary).
//!
//! Initialised as BERT's `BertPreTrainedModel._init_weights`: linear layers and embeddings
//! N(0, 0.02) (`initializer_range`), biases 0, layer norms weight 1 and bias 0. The word embedding
//! has no padding row to zero: the synthetic tokens use every id.

use tch::nn::{self, Init, ModuleT};
use tch::{Kind, Tensor};

use super::layers::{self, dropout, embedding_normal, linear_normal};
use super::{InputKind, Loss, ModelOptions, ModuleDef};

const LAYER_NORM_EPS: f64 = 1e-12;
/// BERT's `initializer_range`.
const INIT_STD: f64 = 0.02;

pub fn modules(o: &ModelOptions) -> (Vec<ModuleDef>, Loss, InputKind) {
    let o = o.clone();
    let mut modules = Vec::new();
    let eo = o.clone();
    modules.push(ModuleDef::new("embeddings", move |p: &nn::Path| {
        Embeddings::new(&(p / "embeddings"), &eo)
    }));
    for index in 0..o.layers {
        let lo = o.clone();
        modules.push(ModuleDef::new(
            format!("encoder.layer.{index}"),
            move |p: &nn::Path| EncoderLayer::new(&(p / "encoder" / "layer" / index), &lo),
        ));
    }
    let (hidden, vocab) = (o.hidden, o.vocab_size);
    modules.push(ModuleDef::new("cls", move |p: &nn::Path| {
        let pred = p / "cls" / "predictions";
        let transform = &pred / "transform";
        let dense = linear(&transform / "dense", hidden, hidden);
        let norm = layer_norm(&transform / "LayerNorm", hidden);
        let decoder = linear_normal(&pred / "decoder", hidden, vocab, INIT_STD, false);
        let bias = pred.var("bias", &[vocab], Init::Const(0.0));
        nn::func_t(move |xs, _| {
            xs.apply(&dense)
                .gelu("none")
                .apply(&norm)
                .linear(&decoder.ws, Some(&bias))
        })
    }));
    (
        modules,
        Loss::TokenCrossEntropy,
        InputKind::Tokens {
            seq_len: o.seq_len,
            vocab: o.vocab_size,
        },
    )
}

fn linear(p: nn::Path, d_in: i64, d_out: i64) -> nn::Linear {
    linear_normal(p, d_in, d_out, INIT_STD, true)
}

fn layer_norm(p: nn::Path, hidden: i64) -> nn::LayerNorm {
    layers::layer_norm(p, hidden, LAYER_NORM_EPS)
}

#[derive(Debug)]
struct Embeddings {
    word: nn::Embedding,
    position: nn::Embedding,
    token_type: nn::Embedding,
    norm: nn::LayerNorm,
    dropout: f64,
}

impl Embeddings {
    fn new(p: &nn::Path, o: &ModelOptions) -> Embeddings {
        Embeddings {
            word: embedding_normal(p / "word_embeddings", o.vocab_size, o.hidden, INIT_STD),
            position: embedding_normal(p / "position_embeddings", o.seq_len, o.hidden, INIT_STD),
            token_type: embedding_normal(p / "token_type_embeddings", 2, o.hidden, INIT_STD),
            norm: layer_norm(p / "LayerNorm", o.hidden),
            dropout: o.dropout,
        }
    }
}

impl ModuleT for Embeddings {
    fn forward_t(&self, ids: &Tensor, train: bool) -> Tensor {
        let seq = ids.size()[1];
        let positions = Tensor::arange(seq, (Kind::Int64, ids.device())).unsqueeze(0);
        let token_types = Tensor::zeros_like(&positions);
        let xs =
            ids.apply(&self.word) + positions.apply(&self.position) + token_types.apply(&self.token_type);
        dropout(xs.apply(&self.norm), self.dropout, train)
    }
}

#[derive(Debug)]
struct EncoderLayer {
    query: nn::Linear,
    key: nn::Linear,
    value: nn::Linear,
    attn_out: nn::Linear,
    attn_norm: nn::LayerNorm,
    intermediate: nn::Linear,
    output: nn::Linear,
    out_norm: nn::LayerNorm,
    heads: i64,
    dropout: f64,
}

impl EncoderLayer {
    fn new(p: &nn::Path, o: &ModelOptions) -> EncoderLayer {
        let h = o.hidden;
        let attention = p / "attention";
        let own = &attention / "self";
        let out = &attention / "output";
        EncoderLayer {
            query: linear(&own / "query", h, h),
            key: linear(&own / "key", h, h),
            value: linear(&own / "value", h, h),
            attn_out: linear(&out / "dense", h, h),
            attn_norm: layer_norm(&out / "LayerNorm", h),
            intermediate: linear(p / "intermediate" / "dense", h, 4 * h),
            output: linear(p / "output" / "dense", 4 * h, h),
            out_norm: layer_norm(p / "output" / "LayerNorm", h),
            heads: o.heads,
            dropout: o.dropout,
        }
    }

    fn split_heads(&self, xs: Tensor, batch: i64, seq: i64, hidden: i64) -> Tensor {
        xs.view([batch, seq, self.heads, hidden / self.heads])
            .transpose(1, 2)
    }
}

impl ModuleT for EncoderLayer {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let (batch, seq, hidden) = xs.size3().expect("encoder input is [batch, seq, hidden]");
        let q = self.split_heads(xs.apply(&self.query), batch, seq, hidden);
        let k = self.split_heads(xs.apply(&self.key), batch, seq, hidden);
        let v = self.split_heads(xs.apply(&self.value), batch, seq, hidden);
        let p_attn = if train { self.dropout } else { 0.0 };
        let context =
            Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, p_attn, false, None, false)
                .transpose(1, 2)
                .reshape([batch, seq, hidden]);
        let attn = dropout(context.apply(&self.attn_out), self.dropout, train);
        let xs = (attn + xs).apply(&self.attn_norm);
        let inner = xs.apply(&self.intermediate).gelu("none");
        let ys = dropout(inner.apply(&self.output), self.dropout, train);
        (ys + xs).apply(&self.out_norm)
    }
}
