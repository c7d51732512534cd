"""Evaluation beyond the trained context: perplexity on long documents, passkey retrieval,
RULER-lite, the method-by-method comparison grid and the search for the best setting, behind
``ggufrope eval ppl | passkey | ruler | compare`` and ``ggufrope tune``.

The package owns the evaluation's model loading and decoding, its protocols, its cache of
computed units and its reports; it imports nothing heavy here (llama_cpp, matplotlib and tqdm
are imported where used). Modules:

- :mod:`.decoder`: :class:`~.decoder.Setting` (a method with k resolved per context),
  :func:`~.decoder.load_model`, :class:`~.decoder.Decoder` (batched low-level decoding),
  :func:`~.decoder.token_nll`, :func:`~.decoder.greedy_answer`; k and dynamic k.
- :mod:`.ppl`: perplexity after llama-perplexity's protocol, beyond and within L; the texts.
- :mod:`.passkey`: passkey retrieval (Mohtashami & Jaggi 2023).
- :mod:`.ruler`: RULER-lite's tasks (Hsieh et al. 2024), prompts in the chat template, scoring.
- :mod:`.cache`: the unit cache (one JSON file per unit), unit keys, the model fingerprint and
  the library build a unit was computed with.
- :mod:`.units`: one unit at a time through the cache (:class:`~.units.UnitRunner`).
- :mod:`.grid`: the comparison grid (:func:`~.grid.run_compare`).
- :mod:`.report`: the markdown table and the plot of a grid's results.
- :mod:`.tune`: ``ggufrope tune``'s coarse-to-fine search and its report.
- :mod:`.cli`: the ``ggufrope eval`` command group, ``ggufrope tune`` and their flag parsers.
"""
