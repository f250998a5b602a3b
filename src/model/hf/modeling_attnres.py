"""An attnres model (Llama with Attention Residuals) for Hugging Face `transformers`.

attnres writes this file into every checkpoint of a Block or Full AttnRes model, beside
configuration_attnres.py, so that transformers (and lm-eval's `hf` backend) load the model
with `trust_remote_code=True`. It needs only torch and transformers and follows the method as the
attnres repository's docs/method.md states it:

- The network is a Llama (RMSNorm with gain, rotate-half rotary embedding, grouped-query causal
  attention, SwiGLU, no biases). Each attention and each MLP is one *sublayer*; a model of n
  layers has L = 2n sublayers.
- Instead of the residual sum, the input of every sublayer is a *depth attention* over sources:
  the token embedding, the sums of completed blocks of sublayer outputs (for Full AttnRes every
  output is its own block) and, inside a block, the partial sum of its outputs so far:
      logit_i = <q ⊙ γ, v_i> / rms(v_i),   α = softmax_i(logit),   h = Σ_i α_i v_i
  with a learned pseudo-query q and key-norm gain γ per consumer, raw values, no 1/sqrt(d).
- One more depth attention over the embedding and every block sum feeds the final norm.
- The ablation keys (`attn_res_key_norm`, `attn_res_query`, `attn_res_gate`, `attn_res_heads`,
  `attn_res_window`) change that attention as docs/method.md §5 describes.

Depth attention mixes one token's own sources only, so the key/value cache is all that
generation keeps between steps.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_attnres import AttnResConfig


def rms_normalise(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return rms_normalise(x, self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)

    def forward(self, x, rope, mask, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, rope), rotate(k, rope)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        # A fully masked row (a padding position) gives NaN; it is never read.
        o = torch.nan_to_num(o)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate(x, rope):
    """Rotate-half rotary embedding; x [B, heads, T, hd], rope = (cos, sin) [B, T, hd]."""
    cos, sin = rope[0][:, None], rope[1][:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def depth_parameters(cfg, sources):
    """One consumer's depth-attention parameters as the checkpoint names them: `*_res_proj`
    (the pseudo-query [1, d], the input-dependent query matrix [d, d], or one value per distinct
    source for content-free mixing) and `*_res_norm` (the key-norm gain; None without key norm
    and for content-free mixing, which reads no keys)."""
    d, query = cfg.hidden_size, cfg.attn_res_query
    shape = {"static": (1, d), "input": (d, d)}.get(query, (1, sources))
    proj = nn.Linear(shape[1], shape[0], bias=False)
    proj.depth_init = 1.0 if query == "dense" else 0.0
    norm = RMSNorm(d, cfg.rms_norm_eps) if query in ("static", "input") and cfg.attn_res_key_norm else None
    return proj, norm


def depth_attention(cfg, proj, norm, values, columns):
    """One consumer's depth attention over `values` (the sources it reads, each [B, T, d]);
    `columns` are their indices among the model's distinct sources (the order of the scalar and
    dense weights)."""
    V = torch.stack(values, dim=2)  # [B, T, K, d]
    B, T, K, d = V.shape
    H, query, eps = cfg.attn_res_heads, cfg.attn_res_query, cfg.rms_norm_eps
    if query in ("scalar", "dense"):
        logits = proj.weight[0, columns].view(1, 1, K, 1).expand(B, T, K, 1)
    else:
        if query == "static":
            q = proj.weight[0].expand(B, T, d)
        else:
            q = rms_normalise(V.sum(2), eps) @ proj.weight.T
        if norm is not None:
            q = q * norm.weight
        keys = rms_normalise(V, eps) if cfg.attn_res_key_norm else V
        logits = (keys.view(B, T, K, H, d // H) * q.view(B, T, 1, H, d // H)).sum(-1)
    if query == "dense":
        alpha = logits
    elif cfg.attn_res_gate == "sigmoid":
        alpha = logits.sigmoid()
    else:
        alpha = logits.softmax(2)
    return (alpha.unsqueeze(-1) * V.view(B, T, K, H, d // H)).sum(2).reshape(B, T, d)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer, sources):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if cfg.residual != "standard":
            self.attn_res_proj, self.attn_res_norm = depth_parameters(cfg, sources)
            self.mlp_res_proj, self.mlp_res_norm = depth_parameters(cfg, sources)


class Sources:
    """The depth sources of one forward pass: the embedding and the completed block sums, and
    the partial sum of the current block (docs/method.md §3-4)."""

    def __init__(self, embedding, cfg, L):
        self.blocks, self.partial = [embedding], None
        self.size, self.L = cfg.sublayers_per_block(), L
        self.window = cfg.attn_res_window
        self.partial_column = 1 + -(-L // self.size) if self.size > 1 else None

    def read(self):
        n = len(self.blocks)
        first = max(n - self.window, 1) if self.window > 0 else 1
        idx = [0] + list(range(first, n))
        values, columns = [self.blocks[i] for i in idx], idx
        if self.partial is not None:
            values, columns = values + [self.partial], columns + [self.partial_column]
        return values, columns

    def add(self, l, out):
        self.partial = out if self.partial is None else self.partial + out
        if (l + 1) % self.size == 0 or l + 1 == self.L:
            self.blocks.append(self.partial)
            self.partial = None


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = False

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear) and hasattr(module, "depth_init"):
            # Zero pseudo-queries: every mix starts as the plain average (dense starts at 1).
            nn.init.constant_(module.weight, module.depth_init)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class AttnResModel(AttnResPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        cfg, L = config, 2 * config.num_hidden_layers
        S = cfg.sublayers_per_block()
        sources = 0 if S is None else 1 + -(-L // S) + (S > 1)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, sources) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.residual != "standard":
            self.output_attn_res_proj, self.output_attn_res_norm = depth_parameters(cfg, sources)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        e = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = e.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        mask, positions = self._mask_and_positions(attention_mask, position_ids, B, T, past, e.device)
        # Computed here, not kept as a buffer: transformers builds the model on the meta device.
        hd = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=e.device) / hd))
        angles = positions[..., None].float() * inv_freq
        angles = torch.cat([angles, angles], -1)
        rope = (angles.cos().to(e.dtype), angles.sin().to(e.dtype))
        cache = past_key_values if use_cache else None
        L = 2 * len(self.layers)
        if self.config.residual == "standard":
            h = e
            for layer in self.layers:
                h = h + layer.self_attn(layer.input_layernorm(h), rope, mask, cache)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        else:
            cfg, src = self.config, Sources(e, self.config, L)
            for i, layer in enumerate(self.layers):
                h = depth_attention(cfg, layer.attn_res_proj, layer.attn_res_norm, *src.read())
                src.add(2 * i, layer.self_attn(layer.input_layernorm(h), rope, mask, cache))
                h = depth_attention(cfg, layer.mlp_res_proj, layer.mlp_res_norm, *src.read())
                src.add(2 * i + 1, layer.mlp(layer.post_attention_layernorm(h)))
            h = depth_attention(cfg, self.output_attn_res_proj, self.output_attn_res_norm, *src.read())
        return self.norm(h), past_key_values

    @staticmethod
    def _mask_and_positions(attention_mask, position_ids, B, T, past, device):
        """A boolean mask [B, 1, T, past + T] (causal, and padding from a 2D attention mask)
        and the positions [B, T] (counted over the tokens the 2D mask keeps)."""
        total = past + T
        q_pos = torch.arange(past, total, device=device)
        allowed = torch.arange(total, device=device)[None, :] <= q_pos[:, None]
        allowed = allowed[None, None].expand(B, 1, T, total)
        if attention_mask is not None and attention_mask.dim() == 4:
            m = attention_mask
            allowed = allowed & (m.bool() if m.dtype == torch.bool else m == 0)
        elif attention_mask is not None:
            keep = attention_mask[:, -total:].bool()
            allowed = allowed & keep[:, None, None, :]
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        if position_ids is None:
            position_ids = q_pos[None].expand(B, T)
        return allowed, position_ids


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = AttnResModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        h, cache = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            # transformers' convention: labels are the inputs; position t predicts t + 1.
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
