"""`miles serve`: miles' own engine behind SGLang's native HTTP API, with continuous batching.

    cli.py        flags and their checks (torch-free), then server.py
    server.py     tokenizer + model + LocalEngine + scheduler, run under uvicorn
    app.py        the FastAPI routes, API-key check, error bodies
    protocol.py   SGLang's request/response shapes: parsing, validation, response objects
    scheduler.py  the thread that owns the model: admission, decode steps, pause, aborts, weight updates
    batch.py      the running batch's KV cache: prefill and merge, one decode step, drop rows
    weights.py    /update_weights_from_disk: a safetensors checkpoint, checked before it is copied in
    types.py      what crosses between the HTTP side and the scheduler
"""
