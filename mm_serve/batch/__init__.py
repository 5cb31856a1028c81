"""The server-side OpenAI Batch API: uploaded files, batches, and the rows they run.

Modules, one job each:

* :mod:`~mm_serve.batch.records`: a file's and a batch's stored record, as OpenAI objects;
* :mod:`~mm_serve.batch.store`: the SQLite database of those records;
* :mod:`~mm_serve.batch.files`: file contents under ``batch.data_dir``, the disk bound;
* :mod:`~mm_serve.batch.validation`: an input file read and checked line by line;
* :mod:`~mm_serve.batch.row_backend`: one row answered by the server's own route code;
* :mod:`~mm_serve.batch.finalize`: a batch's results split into its output and error files;
* :mod:`~mm_serve.batch.runner`: running, resuming, cancelling and expiring batches;
* :mod:`~mm_serve.batch.service`: what the HTTP routes call (:mod:`mm_serve.batch.routes`).

A batch runs on the caption job's machinery (:mod:`mm_serve.caption`): the input
file is parsed by its OpenAI batch reader, rows run in its in-flight window
(:class:`~mm_serve.caption.runner.CaptionJob`) and are appended to a results file
by its resumable writer (:class:`~mm_serve.caption.output.OutputFile`), which is
what makes a restarted server skip the rows already done.
"""
