"""A model named by its Hugging Face config, for ``partc plan`` and ``partc train``:
``partc plan llama --hf-config num_hidden_layers=2 --seq-len 512`` or ``partc plan
path/to/model`` (a directory with ``config.json``, or that file); a composite config's
text model by dotted keys: ``partc plan gemma3 --hf-config
text_config.num_hidden_layers=2``.

A target that is not ``file.py:factory`` is a config: a local directory (or its
``config.json``), read by ``AutoConfig.from_pretrained`` with local files only, a hub
model's name (``meta-llama/Llama-3.1-8B``) whose config the local Hugging Face cache
holds, or a model type that transformers ships (``llama``, ``qwen2``, ``mistral``, ...:
``AutoConfig.for_model``), each with the ``--hf-config KEY=VALUE`` overrides (values
read as JSON where they parse: ``2``, ``true``, ``[1, 2]``; else strings). Nothing is
downloaded. The model is the config's causal LM (``AutoModelForCausalLM.from_config``,
no KV cache; an encoder-decoder's sequence-to-sequence LM, ``AutoModelForSeq2SeqLM``,
whose decoder reads the labels shifted right), built on the meta device for ``partc
plan`` (nothing allocated: a 70B config plans on a laptop) and with the seed's random
weights for ``partc train``; it trains in the dtype its config names (a model
directory's ``"dtype": "bfloat16"``) unless ``--dtype`` says otherwise (without either:
bf16 mixed precision on a GPU, float32 on a CPU). Its example batch is what a tokenizer
gives and the model is called with, ``model(**batch)``: ``input_ids`` of
``--global-batch`` (default 8) by ``--seq-len`` (default the config's
``max_position_embeddings``, at most 2048), unpadded (a mask of ones, which an
encoder-decoder's batch has, would say nothing more). A causal LM trains on the next
tokens with :func:`next_token_loss`, the cross-entropy its own loss computes from
labels, written on the logits: a sequence split over ranks (context parallelism) holds
each position's target, which the model's shift of its labels inside a shard does not.
An encoder-decoder, and a model whose own loss adds terms (a mixture of experts' router
loss, ``output_router_logits``), take ``labels`` too and train on their own loss
(``partc.runtime.label_weights``).

Until a data flag gives real text, ``partc train`` feeds such a model random tokens,
the same for a step on every rank and every run (``data(step)``, seeded by the step).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import re
from pathlib import Path
from typing import Any, Sequence

DEFAULT_BATCH = 8
MAX_DEFAULT_SEQ = 2048
_FACTORY = re.compile(r"\.py:[A-Za-z_][A-Za-z0-9_]*$")
# A model's name on the Hugging Face hub: owner/model.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# A value that holds another KEY=VALUE after a comma: pairs joined in one word.
_JOINED = re.compile(r",\s*([A-Za-z_][A-Za-z0-9_.]*=)")


def is_config_target(target: str) -> bool:
    """A target that names a Hugging Face config, not ``file.py:factory``."""
    return not _FACTORY.search(target) and not target.endswith(".py")


def config_file(target: str) -> Path | None:
    """The ``config.json`` a local target names, None for a model type's name; raises
    ValueError for a path without one."""
    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{target} holds no config.json: give a Hugging Face model "
                             "directory, a model type such as llama, or file.py:factory")
        return path / "config.json"
    if path.suffix == ".json" or "/" in target or "\\" in target:
        if path.is_file():
            return path
        if _HUB_NAME.match(target):
            return _cached_config(target)
        raise ValueError(f"no such file or directory: {target}")
    return None


def _cached_config(name: str) -> Path:
    """The ``config.json`` of the Hugging Face hub model ``name`` (``owner/model``) where
    the local Hugging Face cache holds it (a model downloaded before); nothing is
    downloaded, so elsewhere a ValueError that says how to fetch it."""
    cached = None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id=name, filename="config.json")
    except (ImportError, ValueError):   # no hub client; a name the hub cannot hold
        pass
    if isinstance(cached, str) and Path(cached).is_file():
        return Path(cached)
    raise ValueError(f"{name}: no such directory, and the Hugging Face cache holds no "
                     f"config.json of it (partc downloads nothing): fetch it with "
                     f"'hf download {name} config.json --local-dir DIR' and give DIR")


def overrides(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` words as config fields: VALUE read as JSON where it parses. A dotted
    KEY sets a field of a nested config (``text_config.num_hidden_layers=2``: a
    composite config's text model), as a dict transformers merges into that config."""
    fields: dict[str, Any] = {}
    for pair in pairs or ():
        key, equals, value = pair.partition("=")
        path = [part.strip() for part in key.split(".")]
        if not equals or not all(path):
            raise ValueError(f"--hf-config takes KEY=VALUE words, got {pair!r} (the model "
                             "goes before the flag: partc plan llama --hf-config "
                             "num_hidden_layers=2)")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
            if _JOINED.search(value):
                apart = " ".join(_JOINED.sub(r" \1", pair).split())
                raise ValueError(f"--hf-config takes one KEY=VALUE per word, separated by "
                                 f"spaces, got {pair!r}: --hf-config {apart}") from None
        place, last = fields, path[-1]
        for part in path[:-1]:
            place = place.setdefault(part, {})
            if not isinstance(place, dict):
                break
        known = place.get(last) if isinstance(place, dict) else None
        if not isinstance(place, dict) or isinstance(known, dict) and not isinstance(
                parsed, dict):
            raise ValueError(f"--hf-config sets a field and a field inside it ({pair!r}): "
                             "give one or the other")
        if isinstance(known, dict):
            known.update(parsed)
        else:
            place[last] = parsed
    return fields


def load_config(target: str, pairs: Sequence[str] | None = None) -> Any:
    """The transformers config ``target`` names, with the overrides and no KV cache."""
    from transformers import CONFIG_MAPPING, AutoConfig

    fields = {**overrides(pairs), "use_cache": False}
    file = config_file(target)
    if file is None and target not in CONFIG_MAPPING:
        close = difflib.get_close_matches(target, list(CONFIG_MAPPING.keys()), n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ValueError(f"{target!r} is no model type transformers knows{hint}, no "
                         "directory with config.json and no file.py:factory")
    try:
        if file is not None:
            config = AutoConfig.from_pretrained(str(file), local_files_only=True, **fields)
        else:
            config = AutoConfig.for_model(target, **fields)
    except Exception as error:   # a field's value the config's own checks refuse
        raise ValueError(f"{target}: transformers refused the config "
                         f"({_first_line(error)})") from error
    text_config(config).use_cache = False   # a composite config's text model caches too
    return config


def text_config(config: Any) -> Any:
    """The config of the model's text decoder: a composite config's ``text_config``
    (Gemma 3's, Qwen 3.5's), an encoder-decoder's decoder config, else ``config``."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
        else config


def _first_line(error: Exception) -> str:
    """``Type: first line of the message``, for a one-line error (and the next line
    where the first ends in a colon: pydantic-style "error for field 'x':")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else \
        (lines[0] if lines else "")
    return f"{type(error).__name__}: {text}"


def workload(target: str, pairs: Sequence[str] | None = None, *, batch: int | None = None,
             seq_len: int | None = None, meta: bool = False) -> dict[str, Any]:
    """What a factory returns, for the causal (or sequence-to-sequence) LM of
    ``target``'s config: ``model``, ``example_inputs`` (keyword tensors, labels among
    them), ``name`` and ``data``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = load_config(target, pairs)
    # An encoder-decoder (T5, BART) is its conditional generation model, fed the same
    # batch: the decoder's inputs are the labels shifted right, as the model makes them.
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    kind = "sequence-to-sequence LM" if seq2seq else "causal LM"
    if seq2seq and getattr(config, "decoder_start_token_id", None) is None:
        # A model type's bare config may lack it (T5's): the padding token, as T5 starts.
        pad = getattr(config, "pad_token_id", None)
        config.decoder_start_token_id = 0 if pad is None else pad
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    if type(config) not in auto._model_mapping:
        raise ValueError(f"{target}: {type(config).__name__} has no {kind} in "
                         "transformers; write a factory (file.py:factory) for other models")
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = auto.from_config(config)
    except Exception as error:   # the model's own code, on a config it does not expect
        raise ValueError(f"{target}: transformers could not build the model from this "
                         f"config ({_first_line(error)}); a field its code "
                         f"reads may be unset{unset_hint(config)}: give it with --hf-config "
                         "KEY=VALUE") from error
    batch = batch or DEFAULT_BATCH
    vocab, longest = token_figures(target, config)
    seq_len = seq_len or min(longest, MAX_DEFAULT_SEQ)
    own_loss = seq2seq or bool(getattr(text_config(config), "output_router_logits", False))
    made = token_batch if own_loss else next_token_batch
    row = seq_len if own_loss else seq_len + 1   # next_token_batch: each row's next token

    def data(step: int) -> tuple[dict[str, torch.Tensor], Any]:
        generator = torch.Generator().manual_seed(step)
        return made(torch.randint(0, vocab, (batch, row), generator=generator))

    inputs, target_ids = made(torch.zeros(batch, row, dtype=torch.long))
    return {"model": model, "name": f"{type(model).__name__} ({Path(target).name})",
            "example_inputs": inputs, "data": data, "dtype": config_dtype(config),
            **({} if own_loss else {"loss_fn": next_token_loss,
                                    "example_target": target_ids})}


def unset_fields(config: Any) -> tuple[str, ...]:
    """The fields of ``config`` (its model type's own, not every config's) that hold
    None: what a bare config of the type leaves for a checkpoint's config.json to give
    (DeepSeek-V2's ``num_experts_per_tok``, which its router passes to ``topk``); token
    ids (padding, start, end) are not counted: the model's forward reads none of them."""
    from transformers import PretrainedConfig

    common = set(PretrainedConfig().to_dict())
    return tuple(name for name, value in config.to_dict().items()
                 if value is None and name not in common and not name.endswith("_token_id"))


def unset_hint(config: Any) -> str:
    """`` (this config leaves n_group and num_experts_per_tok unset)``, or nothing."""
    unset = unset_fields(config)
    if not unset:
        return ""
    names = ", ".join(unset[:-1]) + (" and " if len(unset) > 1 else "") + unset[-1]
    return f" (this config leaves {names} unset)"


def config_dtype(config: Any) -> str | None:
    """The dtype the config says the model's weights are in (``dtype``, formerly
    ``torch_dtype``: a model directory's ``"bfloat16"``), as ``--dtype`` names it; None
    where it names none or one training does not take (a quantized model's int8)."""
    # (reading torch_dtype where dtype exists warns of its deprecation)
    named = getattr(config, "dtype") if hasattr(config, "dtype") else getattr(
        config, "torch_dtype", None)
    name = str(named).removeprefix("torch.") if named is not None else None
    return name if name in ("float32", "bfloat16", "float16") else None


def token_figures(target: str, config: Any) -> tuple[int, int]:
    """The vocabulary and the longest sequence (``MAX_DEFAULT_SEQ`` where the config
    gives none) of the model's tokens, as its :func:`text_config` gives them."""
    text = text_config(config)
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"{target}: {type(config).__name__} gives no vocabulary size for "
                         "its text; give it with --hf-config (vocab_size=N, or "
                         "text_config.vocab_size=N)")
    longest = getattr(text, "max_position_embeddings", None)
    # Some configs say -1 or None (XLNet's: relative positions, no limit).
    if not isinstance(longest, int) or longest <= 0:
        longest = MAX_DEFAULT_SEQ
    return vocab, longest


def token_batch(ids: Any) -> tuple[dict[str, Any], None]:
    """A batch of unpadded token rows for the model's own loss
    (:func:`partc.corpus.sources.token_batch`), and no target."""
    from partc.corpus.sources import token_batch as own_loss_batch

    return own_loss_batch(ids), None


def next_token_batch(ids: Any) -> tuple[dict[str, Any], Any]:
    """A batch for :func:`next_token_loss` from unpadded rows of one token more than the
    sequence (as a pre-training corpus packs them): each row but its last token, and
    each position's next token as the target, all counted. Every position counting, a
    sequence split over context-parallel ranks gives each the same number of them, so
    the mean of the ranks' means is the batch's. No attention mask: one of ones says
    nothing the model does not assume without it, and an input mask depends on the
    batch, which keeps context parallelism out."""
    return {"input_ids": ids[:, :-1].contiguous()}, ids[:, 1:].contiguous()


def next_token_loss(output: Any, target: Any) -> Any:
    """A causal LM's loss as its own ``ForCausalLMLoss`` computes it from labels already
    shifted: the mean cross-entropy of the logits (in fp32) against the next tokens, -100
    not counted. Given as a loss on the logits, a sequence split over ranks (context
    parallelism) holds each position's target, which a shift of the labels inside the
    model does not."""
    import torch.nn.functional as F

    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten(),
                           ignore_index=-100)
