"""Hugging Face model families from tiny configs, as a user would bring them.

Every family builds with the attention its config picks by default (``sdpa`` where the
family has it), no KV cache, and every dropout off: parity with one process cuts the
batch into microbatches, which draw other dropout masks. Each family says what its
inputs and loss are:

- ``tokens``: a causal LM, ``model(ids).logits`` against the next tokens;
- ``hidden``: an encoder, ``model(ids).last_hidden_state`` against a float target;
- ``pixels``: a vision encoder, ``model(images).last_hidden_state`` likewise;
- ``seq2seq``: an encoder-decoder, ``model(ids, decoder_ids).logits`` against tokens;
- ``audio``: a speech encoder-decoder, ``model(features, decoder_ids).logits`` likewise;
- ``vlm``: a vision-language model, ``model(ids, images).logits`` against the next
  tokens, each image's features in place of its image tokens.

``benchmarks/hf_coverage.py`` compiles and trains every family under pp=2 and tp=2;
``tests/runtime/worker.py`` registers them as cases ``hf-<family>-pp2`` / ``-tp2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB, POSITIONS = 64, 4, 2, 2, 128, 64
# Every key of a config that names a dropout probability (stochastic depth's and
# LayerDrop's included: a layer skipped by a random draw is a branch on a value, which no
# plan can hold).
_DROPOUT_WORDS = ("dropout", "pdrop", "drop_path", "layerdrop")


@dataclass(frozen=True)
class Family:
    """How to build one family's model and what it trains on."""
    config: str        # the transformers config class
    model: str         # the transformers model class
    data: str          # tokens | hidden | pixels | seq2seq | audio
    fields: dict[str, Any]

    def build(self) -> nn.Module:
        import transformers

        config = getattr(transformers, self.config)(**self.fields)
        for key, value in config.to_dict().items():
            if any(word in key for word in _DROPOUT_WORDS) and isinstance(value, float):
                setattr(config, key, 0.0)
        model = getattr(transformers, self.model)(config)
        if self.data in ("seq2seq", "audio"):
            return DecoderLogits(model)
        return model


class DecoderLogits(nn.Module):
    """An encoder-decoder called with its encoder input and the decoder's tokens by
    position (its own forward takes them as keywords far apart)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.encoder_input = ("input_features" if model.main_input_name == "input_features"
                              else "input_ids")

    def forward(self, inputs: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.encoder_input: inputs},
                          decoder_input_ids=decoder_ids).logits


_COMMON = dict(use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_DECODER = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                intermediate_size=2 * HIDDEN, vocab_size=VOCAB, num_hidden_layers=LAYERS,
                max_position_embeddings=POSITIONS, **_COMMON)
_MOE = dict(num_experts_per_tok=2, output_router_logits=False)
_ENCODER = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                intermediate_size=2 * HIDDEN, vocab_size=VOCAB,
                max_position_embeddings=POSITIONS, pad_token_id=0)
_SEQ2SEQ = dict(d_model=HIDDEN, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_ffn_dim=2 * HIDDEN,
                decoder_ffn_dim=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                decoder_start_token_id=0, **_COMMON)
_T5 = dict(d_model=HIDDEN, d_kv=16, d_ff=2 * HIDDEN, num_heads=HEADS, num_layers=LAYERS,
           num_decoder_layers=LAYERS, vocab_size=VOCAB, decoder_start_token_id=0,
           use_cache=False, pad_token_id=0, eos_token_id=1)
# Multi-head latent attention (DeepSeek's, MiniCPM3's): it makes a key per query head.
_LATENT = dict(num_key_value_heads=HEADS, kv_lora_rank=16, q_lora_rank=32,
               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
# DeepSeek V2/V3's mixture of experts beside it: shared experts, a dense first layer.
_DEEPSEEK_MOE = dict(_LATENT, n_routed_experts=4, n_shared_experts=1,
                     moe_intermediate_size=HIDDEN, first_k_dense_replace=1, n_group=1,
                     topk_group=1, **_MOE)
# Gated delta-rule layers (Qwen 3.5), one before a softmax-attention layer.
_LINEAR_ATTENTION = dict(linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         layer_types=["linear_attention", "full_attention"])
_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, num_attention_heads=2,
               num_hidden_layers=LAYERS, intermediate_size=HIDDEN, image_size=16,
               patch_size=8, num_channels=3)

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", "tokens", _DECODER),
    "mistral": Family("MistralConfig", "MistralForCausalLM", "tokens",
                      dict(_DECODER, sliding_window=8)),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", "tokens", _DECODER),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", "tokens", dict(_DECODER, head_dim=16)),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", "tokens", dict(_DECODER, head_dim=16)),
    # Sliding-window and global layers alternate; logits and attention scores softcapped.
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", "tokens",
                     dict(_DECODER, head_dim=16, sliding_window=8)),
    # One sliding-window layer then one global one, each with its own rotary base.
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", "tokens",
                     dict(_DECODER, head_dim=16, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"])),
    "phi": Family("PhiConfig", "PhiForCausalLM", "tokens",
                  dict(_DECODER, partial_rotary_factor=0.5)),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", "tokens", _DECODER),
    "falcon": Family("FalconConfig", "FalconForCausalLM", "tokens",
                     dict(hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                          num_hidden_layers=LAYERS, **_COMMON)),
    # Falcon-40B's and -180B's decoder: grouped KV heads in one fused projection, read
    # out by list indexing (``qkv[..., [-2]]``), and two norms per block.
    "falcon-new": Family("FalconConfig", "FalconForCausalLM", "tokens",
                         dict(hidden_size=HIDDEN, num_attention_heads=HEADS,
                              num_kv_heads=KV_HEADS, new_decoder_architecture=True,
                              vocab_size=VOCAB, num_hidden_layers=LAYERS, **_COMMON)),
    "gpt-neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", "tokens",
                       dict(_DECODER, rotary_pct=0.5)),
    "gpt-j": Family("GPTJConfig", "GPTJForCausalLM", "tokens",
                    dict(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB,
                         n_positions=POSITIONS, rotary_dim=8, **_COMMON)),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", "tokens",
                   dict(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB,
                        n_positions=POSITIONS, **_COMMON)),
    "opt": Family("OPTConfig", "OPTForCausalLM", "tokens",
                  dict(hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_dim=2 * HIDDEN,
                       num_hidden_layers=LAYERS, vocab_size=VOCAB, word_embed_proj_dim=HIDDEN,
                       max_position_embeddings=POSITIONS, **_COMMON)),
    "bloom": Family("BloomConfig", "BloomForCausalLM", "tokens",
                    dict(hidden_size=HIDDEN, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB,
                         **_COMMON)),
    "cohere": Family("CohereConfig", "CohereForCausalLM", "tokens", _DECODER),
    "olmo": Family("OlmoConfig", "OlmoForCausalLM", "tokens", _DECODER),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", "tokens", _DECODER),
    "olmo3": Family("Olmo3Config", "Olmo3ForCausalLM", "tokens", _DECODER),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", "tokens", _DECODER),
    "stablelm": Family("StableLmConfig", "StableLmForCausalLM", "tokens", _DECODER),
    "starcoder2": Family("Starcoder2Config", "Starcoder2ForCausalLM", "tokens", _DECODER),
    "glm": Family("GlmConfig", "GlmForCausalLM", "tokens", dict(_DECODER, head_dim=16)),
    "glm4": Family("Glm4Config", "Glm4ForCausalLM", "tokens", dict(_DECODER, head_dim=16)),
    "helium": Family("HeliumConfig", "HeliumForCausalLM", "tokens",
                     dict(_DECODER, head_dim=16)),
    "nemotron": Family("NemotronConfig", "NemotronForCausalLM", "tokens", _DECODER),
    "smollm3": Family("SmolLM3Config", "SmolLM3ForCausalLM", "tokens", _DECODER),
    "exaone4": Family("Exaone4Config", "Exaone4ForCausalLM", "tokens", _DECODER),
    "ernie4_5": Family("Ernie4_5Config", "Ernie4_5ForCausalLM", "tokens",
                       dict(_DECODER, head_dim=16)),
    "seed-oss": Family("SeedOssConfig", "SeedOssForCausalLM", "tokens",
                       dict(_DECODER, head_dim=16)),
    "apertus": Family("ApertusConfig", "ApertusForCausalLM", "tokens", _DECODER),
    "arcee": Family("ArceeConfig", "ArceeForCausalLM", "tokens", _DECODER),
    "hunyuan": Family("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", "tokens",
                      dict(_DECODER, head_dim=16)),
    "bitnet": Family("BitNetConfig", "BitNetForCausalLM", "tokens", _DECODER),
    # More decoders: multi-query attention (StarCoder 1), ALiBi (MPT), sinusoidal
    # positions (XGLM), short convolutions (LFM2), differential attention (DiffLlama).
    "gpt-bigcode": Family("GPTBigCodeConfig", "GPTBigCodeForCausalLM", "tokens",
                          dict(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB,
                               n_positions=POSITIONS, multi_query=True, **_COMMON)),
    "mpt": Family("MptConfig", "MptForCausalLM", "tokens",
                  dict(d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS, vocab_size=VOCAB,
                       max_seq_len=POSITIONS, **_COMMON)),
    "codegen": Family("CodeGenConfig", "CodeGenForCausalLM", "tokens",
                      dict(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB,
                           n_positions=POSITIONS, rotary_dim=8, n_ctx=POSITIONS, **_COMMON)),
    "persimmon": Family("PersimmonConfig", "PersimmonForCausalLM", "tokens",
                        dict(_DECODER, num_key_value_heads=HEADS)),
    "xglm": Family("XGLMConfig", "XGLMForCausalLM", "tokens",
                   dict(d_model=HIDDEN, attention_heads=HEADS, num_layers=LAYERS, ffn_dim=2 * HIDDEN,
                        vocab_size=VOCAB, max_position_embeddings=POSITIONS, **_COMMON)),
    "cohere2": Family("Cohere2Config", "Cohere2ForCausalLM", "tokens",
                      dict(_DECODER, sliding_window=8)),
    "lfm2": Family("Lfm2Config", "Lfm2ForCausalLM", "tokens", _DECODER),
    "doge": Family("DogeConfig", "DogeForCausalLM", "tokens", _DECODER),
    "vaultgemma": Family("VaultGemmaConfig", "VaultGemmaForCausalLM", "tokens",
                         dict(_DECODER, head_dim=16, sliding_window=8)),
    "diffllama": Family("DiffLlamaConfig", "DiffLlamaForCausalLM", "tokens", _DECODER),
    "nanochat": Family("NanoChatConfig", "NanoChatForCausalLM", "tokens", _DECODER),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", "tokens",
                      dict(_DECODER, num_local_experts=4, **_MOE)),
    "qwen2-moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "tokens",
                        dict(_DECODER, num_experts=4, moe_intermediate_size=HIDDEN,
                             shared_expert_intermediate_size=HIDDEN, **_MOE)),
    "qwen3-moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "tokens",
                        dict(_DECODER, head_dim=16, num_experts=4, moe_intermediate_size=HIDDEN,
                             **_MOE)),
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", "tokens",
                    dict(_DECODER, num_experts=4, **_MOE)),
    "deepseek-v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", "tokens",
                          dict(_DECODER, **_DEEPSEEK_MOE)),
    "deepseek-v2": Family("DeepseekV2Config", "DeepseekV2ForCausalLM", "tokens",
                          dict(_DECODER, **_DEEPSEEK_MOE)),
    "granitemoe": Family("GraniteMoeConfig", "GraniteMoeForCausalLM", "tokens",
                         dict(_DECODER, num_local_experts=4, **_MOE)),
    "gpt-oss": Family("GptOssConfig", "GptOssForCausalLM", "tokens",
                      dict(_DECODER, head_dim=16, num_local_experts=4, **_MOE)),
    "llama4": Family("Llama4TextConfig", "Llama4ForCausalLM", "tokens",
                     dict(_DECODER, head_dim=16, num_local_experts=4,   # top-1, as Llama 4
                          intermediate_size_mlp=2 * HIDDEN, **dict(_MOE, num_experts_per_tok=1))),
    # More mixture-of-experts models: shared experts (GLM-4.5, dots.llm1), dense first
    # layers (ERNIE 4.5), a linear-attention layer beside a softmax one (MiniMax).
    "ernie4_5-moe": Family("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", "tokens",
                           dict(_DECODER, head_dim=16, moe_num_experts=4, moe_k=2,
                                moe_intermediate_size=HIDDEN, moe_layer_start_index=1,
                                output_router_logits=False)),
    "glm4-moe": Family("Glm4MoeConfig", "Glm4MoeForCausalLM", "tokens",
                       dict(_DECODER, head_dim=16, n_routed_experts=4, n_shared_experts=1,
                            moe_intermediate_size=HIDDEN, first_k_dense_replace=1, n_group=1,
                            topk_group=1, **_MOE)),
    "dots1": Family("Dots1Config", "Dots1ForCausalLM", "tokens",
                    dict(_DECODER, head_dim=16, n_routed_experts=4, n_shared_experts=1,
                         moe_intermediate_size=HIDDEN, first_k_dense_replace=1, n_group=1,
                         topk_group=1, **_MOE)),
    "hunyuan-moe": Family("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", "tokens",
                          dict(_DECODER, head_dim=16, num_experts=4, moe_topk=2)),
    "minimax": Family("MiniMaxConfig", "MiniMaxForCausalLM", "tokens",
                      dict(_DECODER, head_dim=16, num_local_experts=4, **_MOE)),
    "minimax-m2": Family("MiniMaxM2Config", "MiniMaxM2ForCausalLM", "tokens",
                         dict(_DECODER, head_dim=16, num_local_experts=4, **_MOE)),
    "granitemoe-shared": Family("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", "tokens",
                                dict(_DECODER, num_local_experts=4, shared_intermediate_size=HIDDEN, **_MOE)),
    "flex-olmo": Family("FlexOlmoConfig", "FlexOlmoForCausalLM", "tokens",
                        dict(_DECODER, num_experts=4, **_MOE)),
    # Recurrent: RG-LRU blocks between local attention (RecurrentGemma), selective state
    # spaces (Mamba, Mamba-2's chunked scan).
    "recurrent-gemma": Family("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", "tokens",
                              dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   intermediate_size=2 * HIDDEN, vocab_size=VOCAB, num_hidden_layers=3,
                                   lru_width=HIDDEN, attention_window_size=8, **_COMMON)),
    "mamba": Family("MambaConfig", "MambaForCausalLM", "tokens",
                    dict(hidden_size=HIDDEN, state_size=8, num_hidden_layers=LAYERS, vocab_size=VOCAB,
                         **_COMMON)),
    "mamba2": Family("Mamba2Config", "Mamba2ForCausalLM", "tokens",
                     dict(hidden_size=HIDDEN, state_size=8, num_heads=8, head_dim=16, n_groups=1,
                          num_hidden_layers=LAYERS, vocab_size=VOCAB, chunk_size=8, **_COMMON)),
    # Not here: PhiMoE, whose router samples its experts in training (Gumbel noise and
    # a random midpoint mask): its runs draw other numbers than one process does.
    # Encoders, vision, encoder-decoders.
    "bert": Family("BertConfig", "BertModel", "hidden",
                   dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                        intermediate_size=2 * HIDDEN, vocab_size=VOCAB,
                        max_position_embeddings=POSITIONS, pad_token_id=0)),
    "roberta": Family("RobertaConfig", "RobertaModel", "hidden",
                      dict(hidden_size=HIDDEN, num_attention_heads=HEADS,
                           num_hidden_layers=LAYERS, intermediate_size=2 * HIDDEN,
                           vocab_size=VOCAB, max_position_embeddings=POSITIONS, pad_token_id=1)),
    # DeBERTa-v3's attention: disentangled relative positions (content-to-position and
    # position-to-content scores), shared keys, normed relative embeddings.
    "deberta-v2": Family("DebertaV2Config", "DebertaV2Model", "hidden",
                         dict(hidden_size=HIDDEN, num_attention_heads=HEADS,
                              num_hidden_layers=LAYERS, intermediate_size=2 * HIDDEN,
                              vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                              pad_token_id=0, relative_attention=True,
                              pos_att_type=["p2c", "c2p"], position_buckets=16,
                              max_relative_positions=POSITIONS, norm_rel_ebd="layer_norm",
                              share_att_key=True)),
    # Embeddings narrower than the encoder: a projection widens them, and the masked-LM
    # head narrows the hidden state back to the (tied) embedding's width.
    "electra": Family("ElectraConfig", "ElectraForMaskedLM", "tokens",
                      dict(embedding_size=HIDDEN // 2, hidden_size=HIDDEN,
                           num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                           intermediate_size=2 * HIDDEN, vocab_size=VOCAB,
                           max_position_embeddings=POSITIONS, pad_token_id=0)),
    "albert": Family("AlbertConfig", "AlbertModel", "hidden",
                     dict(embedding_size=32, hidden_size=HIDDEN, num_attention_heads=HEADS,
                          num_hidden_layers=LAYERS, intermediate_size=2 * HIDDEN, vocab_size=VOCAB,
                          max_position_embeddings=POSITIONS, pad_token_id=0)),
    "distilbert": Family("DistilBertConfig", "DistilBertModel", "hidden",
                         dict(dim=HIDDEN, n_heads=HEADS, n_layers=LAYERS, hidden_dim=2 * HIDDEN,
                              vocab_size=VOCAB, max_position_embeddings=POSITIONS, pad_token_id=0)),
    "modernbert": Family("ModernBertConfig", "ModernBertModel", "hidden",
                         dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                              intermediate_size=2 * HIDDEN, vocab_size=VOCAB,
                              max_position_embeddings=POSITIONS, pad_token_id=0, local_attention=8)),
    "xlm-roberta": Family("XLMRobertaConfig", "XLMRobertaModel", "hidden",
                          dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                               intermediate_size=2 * HIDDEN, vocab_size=VOCAB,
                               max_position_embeddings=POSITIONS, pad_token_id=1)),
    "vit": Family("ViTConfig", "ViTModel", "pixels",
                  dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                       intermediate_size=2 * HIDDEN, image_size=32, patch_size=8,
                       num_channels=3)),
    # Vision encoders: layer scale (DINOv2), relative position biases (BEiT), shifted
    # windows and patch merging (Swin), convolutions (ConvNeXt).
    "dinov2": Family("Dinov2Config", "Dinov2Model", "pixels",
                     dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                          mlp_ratio=2, image_size=32, patch_size=8, num_channels=3)),
    "beit": Family("BeitConfig", "BeitModel", "pixels",
                   dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                        intermediate_size=2 * HIDDEN, image_size=32, patch_size=8, num_channels=3)),
    "swin": Family("SwinConfig", "SwinModel", "pixels",
                   dict(embed_dim=16, depths=[2, 2], num_heads=[2, 4], image_size=32, patch_size=4,
                        window_size=4, num_channels=3)),
    "convnext": Family("ConvNextConfig", "ConvNextModel", "pixels",
                       dict(hidden_sizes=[16, 32], depths=[2, 2], num_stages=2, image_size=32, num_channels=3)),    "whisper": Family("WhisperConfig", "WhisperForConditionalGeneration", "audio",
                      dict(d_model=HIDDEN, encoder_attention_heads=HEADS,
                           decoder_attention_heads=HEADS, encoder_layers=LAYERS,
                           decoder_layers=LAYERS, encoder_ffn_dim=2 * HIDDEN,
                           decoder_ffn_dim=2 * HIDDEN, vocab_size=VOCAB, num_mel_bins=16,
                           max_source_positions=16, max_target_positions=POSITIONS,
                           decoder_start_token_id=0, **_COMMON)),
    "bart": Family("BartConfig", "BartForConditionalGeneration", "seq2seq",
                   dict(d_model=HIDDEN, encoder_attention_heads=HEADS,
                        decoder_attention_heads=HEADS, encoder_layers=LAYERS,
                        decoder_layers=LAYERS, encoder_ffn_dim=2 * HIDDEN,
                        decoder_ffn_dim=2 * HIDDEN, vocab_size=VOCAB,
                        max_position_embeddings=POSITIONS, decoder_start_token_id=0,
                        **_COMMON)),
    # A CLIP vision tower and a projector feed a Llama: the image's features take the
    # place of its tokens (a scatter by a mask of the ids), checked by a value assert.
    "llava": Family("LlavaConfig", "LlavaForConditionalGeneration", "vlm",
                    dict(vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                                            num_attention_heads=2, num_hidden_layers=LAYERS,
                                            intermediate_size=HIDDEN, image_size=16,
                                            patch_size=8, num_channels=3),
                         text_config=dict(_DECODER, model_type="llama"),
                         image_token_id=VOCAB - 1, vision_feature_layer=-1,
                         vision_feature_select_strategy="full")),
    # Gemma 3 with its SigLIP tower: the image's features pooled to a few tokens, the
    # text model's sliding-window and global layers.
    "gemma3-vision": Family("Gemma3Config", "Gemma3ForConditionalGeneration", "vlm",
                            dict(vision_config=_SIGLIP, mm_tokens_per_image=4,
                                 text_config=dict(_DECODER, model_type="gemma3_text",
                                                  head_dim=16, sliding_window=8),
                                 image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                                 eoi_token_index=VOCAB - 2)),
    # Not here: PaliGemma, whose text model is bidirectional by config, yet whose eager
    # attention without token_type_ids runs without a mask while a traced one gets a
    # causal mask from transformers (it builds masks differently when traced).
    "mbart": Family("MBartConfig", "MBartForConditionalGeneration", "seq2seq",
                    dict(d_model=HIDDEN, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                         encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_ffn_dim=2 * HIDDEN,
                         decoder_ffn_dim=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                         decoder_start_token_id=0, **_COMMON)),
    "pegasus": Family("PegasusConfig", "PegasusForConditionalGeneration", "seq2seq",
                      dict(d_model=HIDDEN, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                           encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_ffn_dim=2 * HIDDEN,
                           decoder_ffn_dim=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                           decoder_start_token_id=0, **_COMMON)),
    "mt5": Family("MT5Config", "MT5ForConditionalGeneration", "seq2seq",
                  dict(d_model=HIDDEN, d_kv=16, d_ff=2 * HIDDEN, num_heads=HEADS, num_layers=LAYERS,
                       num_decoder_layers=LAYERS, vocab_size=VOCAB, decoder_start_token_id=0,
                       use_cache=False, pad_token_id=0, eos_token_id=1)),
    "t5": Family("T5Config", "T5ForConditionalGeneration", "seq2seq",
                 dict(d_model=HIDDEN, d_kv=16, d_ff=2 * HIDDEN, num_heads=HEADS,
                      num_layers=LAYERS, num_decoder_layers=LAYERS, vocab_size=VOCAB,
                      decoder_start_token_id=0, use_cache=False, pad_token_id=0,
                      eos_token_id=1)),
    # Round 3's newest decoders: Gemma 4 (sliding and global layers), Qwen 3.5 and its
    # MoE (gated linear-attention layers beside softmax ones), Ministral, and latent
    # attention without experts (MiniCPM3); older ones people still fine-tune: GPT-Neo
    # (local and global layers), GPT-1, CTRL, BioGPT.
    "gemma4": Family("Gemma4TextConfig", "Gemma4ForCausalLM", "tokens",
                     dict(_DECODER, head_dim=16, global_head_dim=16, sliding_window=8,
                          vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                          layer_types=["sliding_attention", "full_attention"])),
    "qwen3_5": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "tokens",
                      dict(_DECODER, head_dim=16, **_LINEAR_ATTENTION)),
    "qwen3_5-moe": Family("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "tokens",
                          dict(_DECODER, head_dim=16, **_LINEAR_ATTENTION, num_experts=4,
                               moe_intermediate_size=HIDDEN,
                               shared_expert_intermediate_size=HIDDEN, **_MOE)),
    "ministral": Family("MinistralConfig", "MinistralForCausalLM", "tokens",
                        dict(_DECODER, head_dim=16, sliding_window=8)),
    "minicpm3": Family("MiniCPM3Config", "MiniCPM3ForCausalLM", "tokens",
                       dict(_DECODER, **_LATENT)),
    "gpt-neo": Family("GPTNeoConfig", "GPTNeoForCausalLM", "tokens",
                      dict(hidden_size=HIDDEN, num_heads=HEADS, num_layers=LAYERS,
                           vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                           attention_types=[[["global", "local"], 1]], window_size=8,
                           **_COMMON)),
    "openai-gpt": Family("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", "tokens",
                         dict(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB,
                              n_positions=POSITIONS)),
    "ctrl": Family("CTRLConfig", "CTRLLMHeadModel", "tokens",
                   dict(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, dff=2 * HIDDEN,
                        vocab_size=VOCAB, n_positions=POSITIONS, **_COMMON)),
    "biogpt": Family("BioGptConfig", "BioGptForCausalLM", "tokens", dict(_ENCODER, **_COMMON)),
    # More mixture-of-experts models: Cohere 2's, LFM2's (convolution layers), GLM-4.7-
    # Flash's latent attention, AFMoE. Not here: DBRX, whose experts pick their tokens by
    # torch.nonzero (shapes that depend on values: refused, with what to do instead).
    "cohere2-moe": Family("Cohere2MoeConfig", "Cohere2MoeForCausalLM", "tokens",
                          dict(_DECODER, sliding_window=8, num_experts=4,
                               moe_intermediate_size=HIDDEN, **_MOE)),
    "lfm2-moe": Family("Lfm2MoeConfig", "Lfm2MoeForCausalLM", "tokens",
                       dict(_DECODER, num_experts=4, moe_intermediate_size=HIDDEN,
                            num_dense_layers=1, layer_types=["conv", "full_attention"],
                            **_MOE)),
    "glm4-moe-lite": Family("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", "tokens",
                            dict(_DECODER, **_DEEPSEEK_MOE)),
    "afmoe": Family("AfmoeConfig", "AfmoeForCausalLM", "tokens",
                    dict(_DECODER, head_dim=16, num_experts=4, moe_intermediate_size=HIDDEN,
                         num_dense_layers=1, sliding_window=8, **_MOE)),
    # More encoder-decoders: UMT5 (per-layer relative biases), M2M-100 (NLLB's), Marian,
    # Blenderbot, PLBart. Not here: Switch Transformers, whose decoder without an
    # attention mask makes one only when not compiling, and under export subscripts None.
    "umt5": Family("UMT5Config", "UMT5ForConditionalGeneration", "seq2seq", _T5),
    "m2m100": Family("M2M100Config", "M2M100ForConditionalGeneration", "seq2seq", _SEQ2SEQ),
    "marian": Family("MarianConfig", "MarianMTModel", "seq2seq",
                     dict(_SEQ2SEQ, decoder_vocab_size=VOCAB)),
    "blenderbot": Family("BlenderbotConfig", "BlenderbotForConditionalGeneration", "seq2seq",
                         _SEQ2SEQ),
    "plbart": Family("PLBartConfig", "PLBartForConditionalGeneration", "seq2seq", _SEQ2SEQ),
    # More encoders: Megatron-BERT (pre-norm), MobileBERT (bottlenecks, stacked FFNs),
    # MPNet (relative positions), ConvBERT (span convolutions), RoFormer (rotary),
    # EuroBERT (a Llama-like encoder), Funnel (pooled blocks).
    "megatron-bert": Family("MegatronBertConfig", "MegatronBertModel", "hidden", _ENCODER),
    "mobilebert": Family("MobileBertConfig", "MobileBertModel", "hidden",
                         dict(_ENCODER, embedding_size=32, intra_bottleneck_size=32,
                              true_hidden_size=32, num_feedforward_networks=2)),
    "mpnet": Family("MPNetConfig", "MPNetModel", "hidden", _ENCODER),
    "convbert": Family("ConvBertConfig", "ConvBertModel", "hidden",
                       dict(_ENCODER, embedding_size=HIDDEN)),
    "roformer": Family("RoFormerConfig", "RoFormerModel", "hidden", _ENCODER),
    "eurobert": Family("EuroBertConfig", "EuroBertModel", "hidden",
                       dict(_DECODER, mask_token_id=VOCAB - 1)),
    "funnel": Family("FunnelConfig", "FunnelModel", "hidden",
                     dict(d_model=HIDDEN, n_head=HEADS, d_head=16, d_inner=2 * HIDDEN,
                          block_sizes=[1, 1], vocab_size=VOCAB)),
}


def loss_for(data: str) -> Callable:
    return {"tokens": causal_lm_loss, "tokens-masked": causal_lm_loss,
            "hidden": hidden_mse, "pixels": hidden_mse,
            "seq2seq": logits_loss, "audio": logits_loss, "vlm": causal_lm_loss}[data]


def causal_lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def logits_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def hidden_mse(output, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.last_hidden_state, target)


def padded_batch(model: nn.Module, batch_size: int, seq: int,
                 generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A causal LM's batch as a tokenizer pads it and a user calls ``model(**batch)``:
    ``input_ids``, ``attention_mask`` (0 after each row's length, lengths from 2 to
    ``seq``: microbatches count different numbers of labels), ``position_ids``, and
    ``labels`` (the ids, -100 under padding)."""
    vocab = getattr(model.config, "vocab_size", VOCAB)
    ids = torch.randint(1, vocab, (batch_size, seq), generator=generator)
    lengths = torch.randint(2, seq + 1, (batch_size,), generator=generator)
    lengths[0] = seq
    mask = (torch.arange(seq) < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, getattr(model.config, "pad_token_id", 0) or 0)
    return {"input_ids": ids, "attention_mask": mask,
            "position_ids": torch.arange(seq).expand(batch_size, seq).contiguous(),
            "labels": ids.masked_fill(mask == 0, -100)}


def prompt_batch(model: nn.Module, batch_size: int, seq: int,
                 generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A causal LM's fine-tuning batch, ``model(**batch)``: ``input_ids`` of whole rows
    and ``labels`` (the ids, -100 over each row's prompt, of 0 to ``seq // 2`` tokens:
    microbatches, and a sequence's halves, count different numbers of labels)."""
    vocab = getattr(model.config, "vocab_size", VOCAB)
    ids = torch.randint(1, vocab, (batch_size, seq), generator=generator)
    prompts = torch.randint(0, seq // 2 + 1, (batch_size,), generator=generator)
    return {"input_ids": ids,
            "labels": ids.masked_fill(torch.arange(seq) < prompts[:, None], -100)}


def batch(data: str, model: nn.Module, batch_size: int, seq: int,
          generator: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One batch of ``data``'s kind for ``model``: (inputs, target)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", VOCAB)
    tokens = torch.randint(1, vocab, (batch_size, seq + 1), generator=generator)
    ids, next_ids = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if data == "tokens":
        return (ids,), next_ids
    if data == "tokens-masked":   # each row's prompt (0 to seq // 2 tokens) not counted
        prompts = torch.randint(0, seq // 2 + 1, (batch_size,), generator=generator)
        return (ids,), next_ids.masked_fill(torch.arange(seq) < prompts[:, None], -100)
    if data == "hidden":
        return (ids,), torch.randn(batch_size, seq, config.hidden_size, generator=generator)
    if data == "pixels":
        side, channels = config.image_size, config.num_channels
        images = torch.randn(batch_size, channels, side, side, generator=generator)
        with torch.no_grad():   # the encoder's output, whatever its tokens or maps
            shape = model(images[:1]).last_hidden_state.shape[1:]
        return (images,), torch.randn(batch_size, *shape, generator=generator)
    if data == "seq2seq":
        source = torch.randint(1, vocab, (batch_size, seq), generator=generator)
        return (source, ids), next_ids
    if data == "audio":
        frames = 2 * config.max_source_positions  # the encoder's convolutions halve them
        features = torch.randn(batch_size, config.num_mel_bins, frames, generator=generator)
        return (features, ids), next_ids
    if data == "vlm":
        vision = config.vision_config
        side = vision.image_size
        images = torch.randn(batch_size, vision.num_channels, side, side, generator=generator)
        with torch.no_grad():   # how many features an image makes, each one token's place
            made = model.model.get_image_features(pixel_values=images[:1])
        made = getattr(made, "pooler_output", made)
        features = (made[0] if isinstance(made, (list, tuple)) else made).shape[-2]
        image_token = getattr(config, "image_token_id", None) or config.image_token_index
        ids = ids.masked_fill(ids == image_token, 1)   # image tokens: these alone
        ids[:, 1:1 + features] = image_token
        return (ids, images), next_ids
    raise ValueError(f"unknown data kind {data!r}")
