"""Speculative decoding: drafts from the text itself (n-gram) or from a draft model.

    drafter.py      the Drafter interface and build_drafter (one drafter per engine)
    ngram.py        drafts from the request's own tokens and from the prefix cache's blocks
    draft_model.py  drafts from a model with the same tokenizer, over its own KV pool
    block_index.py  the n-gram index over the prefix cache's blocks
    policy.py       how many tokens a request may draft this step, and the pause after repeated rejections
    verify.py       the acceptance rule in the sampler: greedy (longest agreeing prefix + 1) and sampled

The scheduler lets the drafter prepare the step's drafts at once, then asks it for each running request (policy.py
says how many tokens, if any) and schedules the request's last token plus its draft as one short chunk of decode
rows; the runner computes every row as it would a one-token decode (so a row's result is the same as without
speculation) and verify.py picks what is accepted.
"""
