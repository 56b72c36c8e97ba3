"""The e2e test's model: a tiny DeepSeek-V2-architecture model with random weights, written locally (config,
safetensors, a word-level tokenizer), nothing from a hub. MLA with the real ranks of the architecture's
attention (kv_lora_rank 512, rope 64), small everywhere else, so vLLM's CPU_MLA backend runs it in seconds."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = 2000  # plus special tokens; vocab 2048


def write_model(path: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64,
        first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        architectures=["DeepseekV2ForCausalLM"])
    model = DeepseekV2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i + 4 for i in range(WORDS)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(path)
    cfg_json = json.loads((path / "config.json").read_text())
    cfg_json["architectures"] = ["DeepseekV2ForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg_json, indent=1))
    return path


if __name__ == "__main__":
    import sys
    print(write_model(Path(sys.argv[1])))
