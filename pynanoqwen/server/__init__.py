"""`python -m pynanoqwen serve`: an OpenAI- and llama.cpp-compatible completion server for editors.

Data flows one way, one module per step:
    app.py        HTTP routes (Starlette on uvicorn): API key, body, errors, SSE, disconnects
    protocol.py   request bodies (declared in schema.py) -> GenerationRequest; prompts.py lays out
                  /infill's repository context and knows the tokens that end a fill-in-the-middle
    scheduler.py  one worker thread runs one request at a time through the backend, with KV pages
                  from the prefix cache (../prefix_cache.py); textstream.py applies stop strings
    responses.py  the generated text -> OpenAI or llama.cpp JSON and server-sent events
    metrics.py    Prometheus counters and histograms
    run.py        the `serve` command: load the model like `generate`, bind, print the URLs, run
"""
