"""A tiny Qwen3-MoE as a Hugging Face config dict (what its config.json holds), shared by the tests of estimate,
plan, the command line and the distributed runs: 8 experts of width 32, ``top_k`` routed per token, hidden 64."""


def qwen3_moe_config(top_k=2, layers=3):
    return {"model_type": "qwen3_moe", "vocab_size": 211, "hidden_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": top_k,
            "max_position_embeddings": 128}
