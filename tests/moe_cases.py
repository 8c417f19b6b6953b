"""Tiny mixture-of-experts models as Hugging Face config dicts (what their config.json holds). Qwen3-MoE is shared
by the tests of estimate, plan, the command line and the distributed runs: 8 experts of width 32, ``top_k`` routed
per token, hidden 64; Mixtral and DeepSeek-V3 (latent attention, a dense first layer, a shared expert) by the
distributed runs."""


def qwen3_moe_config(top_k=2, layers=3):
    return {"model_type": "qwen3_moe", "vocab_size": 211, "hidden_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": top_k,
            "max_position_embeddings": 128}


def mixtral_config(layers=2):
    return {"model_type": "mixtral", "vocab_size": 211, "hidden_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "num_local_experts": 4,
            "num_experts_per_tok": 2, "max_position_embeddings": 128}


def deepseek_v3_config(layers=2):
    return {"model_type": "deepseek_v3", "vocab_size": 211, "hidden_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
            "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 128}
