"""What a received file may do: the five principles the plugin's loading keeps.

A checkpoint, archive, model directory, data-bin, results folder or attention dump that someone
sends is input. Through any tool or fairseq entry point with the plugin loaded it cannot run
code, read or write a file outside its own directory, or make the process allocate or work far
beyond what the model it declares needs; and nothing fairseq writes or reads is refused
(docs/safety.md). One place a principle:

1. no code -- :mod:`ea_fairseq.safety.no_code`: weights-only unpickling, the configuration
   fairseq receives generated from its schema, evaluated fields read as literals, no
   interpolation.
2. :mod:`.confined` -- confine every open: a path read from a received directory, or named
   inside a received file, resolves (links followed) to a regular file inside that directory,
   and is opened so that a link swapped in afterwards is not followed.
3. :mod:`.budget` -- budget the effect, not the declaration: what fairseq builds from a
   checkpoint is counted as it is built and bounded by the checkpoint's weights; tools run
   models within ``max_positions``; dumps and logs cause work in proportion to their size.
4. :mod:`.writers` -- every writer is safe: a new file (``O_EXCL``) renamed into place, never
   a write through a link.
5. refuse by use, not by pattern: how the four decide. What fairseq accepts loads (every model
   family, every language code); a field dangerous in one use is neutralised in that use (the
   checkpoint's generation settings and load-time paths), not refused.
"""
