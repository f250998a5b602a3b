"""Configuration of an attnres model for Hugging Face `transformers` (remote code).

attnres writes this file, with modeling_attnres.py, into every checkpoint of a Block or Full
Attention Residuals model, and names both in the `auto_map` of its config.json, so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

loads it. It needs only torch and transformers. The keys are Hugging Face's Llama keys plus the
residual ones of the attnres checkpoint format (docs/checkpoint-format.md in the attnres
repository); `attn_res_block_size` counts transformer layers (two sublayers each).
"""
from transformers import PretrainedConfig

RESIDUALS = ("standard", "full", "block")
QUERIES = ("static", "input", "scalar", "dense")
GATES = ("softmax", "sigmoid")


class AttnResConfig(PretrainedConfig):
    model_type = "attnres"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.02,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        residual="block",
        num_blocks=8,
        attn_res_block_size=None,
        attn_res_key_norm=True,
        attn_res_query="static",
        attn_res_gate="softmax",
        attn_res_heads=1,
        attn_res_window=0,
        use_cache=True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        rope = kwargs.pop("rope_parameters", None) or {}
        self.rope_theta = rope.get("rope_theta", rope_theta)
        self.initializer_range = initializer_range
        self.hidden_act = hidden_act
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.attention_dropout = attention_dropout
        self.residual = residual
        self.num_blocks = num_blocks
        self.attn_res_block_size = attn_res_block_size
        self.attn_res_key_norm = attn_res_key_norm
        self.attn_res_query = attn_res_query
        self.attn_res_gate = attn_res_gate
        self.attn_res_heads = attn_res_heads
        self.attn_res_window = attn_res_window
        self.use_cache = use_cache
        self._check()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _check(self):
        def want(ok, msg):
            if not ok:
                raise ValueError(f"attnres config: {msg}")

        want(self.residual in RESIDUALS, f"residual must be one of {RESIDUALS}, got {self.residual!r}")
        want(self.hidden_act == "silu", f"only hidden_act 'silu' is supported, got {self.hidden_act!r}")
        want(not self.attention_bias and not self.mlp_bias, "biases are not supported")
        want(self.attn_res_query in QUERIES, f"attn_res_query must be one of {QUERIES}")
        want(self.attn_res_gate in GATES, f"attn_res_gate must be one of {GATES}")
        want(self.hidden_size % self.attn_res_heads == 0, "attn_res_heads must divide hidden_size")
        L = 2 * self.num_hidden_layers
        if self.residual == "block":
            if self.attn_res_block_size is not None:
                want(self.attn_res_block_size >= 1, "attn_res_block_size must be at least 1")
            else:
                want(self.num_blocks >= 1 and L % self.num_blocks == 0,
                     f"num_blocks must divide 2 * num_hidden_layers = {L}")

    def sublayers_per_block(self):
        """Sublayers per depth block (the last block may be shorter), or None for standard."""
        if self.residual == "standard":
            return None
        if self.residual == "full":
            return 1
        if self.attn_res_block_size is not None:
            return 2 * self.attn_res_block_size
        return 2 * self.num_hidden_layers // self.num_blocks
