"""The multi-process parts of ``pdlb serve --processes N``: supervision, shared load, prefix views and admin changes, the KV-event fan-out, admission's held work per tenant."""
