"""Batch-invariant kernels: a token's numbers do not depend on what else is in the batch, how the
sequences are packed, or whether it is computed in a prefill, a decode step or the trainer's packed
forward. Each reduction runs in one order fixed by the problem's own sizes (the matmul's K, the
row's width, the key positions), never by the row count; the engine and the trainer call the same
kernels for the same math (`rollout.exact_logprobs`), so the rollout's log-probs are the trainer's
to the bit. Floating-point contraction is off in every kernel here, so a sum written the same way
rounds the same way in any of them.

  linear.py     x @ W^T + b: K in fixed chunks, each chunk's sum from zero, the chunks added in
                order (one program, or one program per chunk plus an ordered reduction: same bits)
  rms_norm.py   one row per program, the row's whole width in one block
  rope.py       rotary on q and k in one launch (elementwise: the PyTorch form's bits)
  attention.py  causal attention over paged K/V: key blocks from position 0 in order, the same
                tile shape for a decode step's one query as for a prompt's thousands
  packed_attention.py
                the trainer's packed rows read as pages of one token, and a backward that sums
                each gradient in one fixed order (runs repeat)
  shared_attention.py
                the same with each prompt packed once for its responses
"""
