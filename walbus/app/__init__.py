"""The application layer: the `walbus` command, the demo, `tail` and the local dev stack.

It sits above the services (producer/, demux/, warehouse/) and may import them; nothing but the
entry point and the tests imports it. The core (the rest of `walbus/`) never imports it.
"""
