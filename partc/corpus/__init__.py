"""Training data from files: token ids read by step, packed into sequences.

What ``partc train --data PATH`` reads, in three steps:

1. **Tokens** (:mod:`partc.corpus.token_files`, :mod:`partc.corpus.text_tokens`): a token
   file (a flat binary of uint16 or uint32 ids, nanoGPT's ``train.bin``, or a ``.npy``)
   is memory-mapped; a text file, or a ``datasets`` data set saved with
   ``save_to_disk``, is tokenized — by a Hugging Face tokenizer from a local directory,
   or by the built-in byte-level tokenizer (UTF-8 bytes, 256 ids, no download).
2. **Packing** (:mod:`partc.corpus.packing`): the token stream is cut into
   ``num_samples = (tokens - 1) // seq`` windows of ``seq + 1`` tokens, window ``i``
   starting at token ``i * seq``; a sample is the window's first ``seq`` tokens (the
   inputs) and its last ``seq`` (the next-token targets). ``seq`` is the model's
   sequence length: the factory's example inputs' second dimension.
3. **Order** (:class:`partc.runtime.data.DataSampler`): step ``s`` reads the samples the
   sampler gives for ``(seed, s)``; each data-parallel replica reads its own rows of
   them. The step is the data position, so a run resumed from a checkpoint of step ``s``
   reads what an uninterrupted run reads next, on any number of processes.

:func:`partc.corpus.sources.open_corpus` does steps 1 and 2 for a path;
:class:`partc.corpus.packing.StepBatches` step 3. Tokenize a large text once into a token
file (:func:`partc.corpus.token_files.write_token_file`) rather than at every launch:
every rank tokenizes a text it is given.
"""

from __future__ import annotations

from partc.corpus.packing import StepBatches, TokenCorpus, model_vocab_size
from partc.corpus.sources import model_batch, open_corpus, sequence_length
from partc.corpus.text_tokens import ByteTokenizer, load_tokenizer
from partc.corpus.token_files import read_token_file, write_token_file

__all__ = ["ByteTokenizer", "StepBatches", "TokenCorpus", "load_tokenizer", "model_batch",
           "model_vocab_size", "open_corpus", "read_token_file", "sequence_length",
           "write_token_file"]
