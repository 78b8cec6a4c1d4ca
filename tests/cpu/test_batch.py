import random

import torch

from hybridflow.batch import pack_sequences, plan_grouped_microbatches, plan_microbatches


def test_pack_sequences_layout():
    mb = pack_sequences([[5, 6, 7], [8], [9, 10]])
    assert mb.input_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert mb.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert mb.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert mb.cu_seqlens.dtype == torch.int32
    assert mb.num_tokens == 6


def test_plan_microbatches_hand_example():
    # first-fit decreasing: 7 -> bin0, 5 -> bin1, 3 -> bin0 (7+3=10), 2 -> bin1, 1 -> bin1
    assert plan_microbatches([3, 7, 5, 2, 1], max_tokens=10) == [[0, 1], [2, 3, 4]]


def test_plan_microbatches_keeps_every_sequence_once_within_budget():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
        budget = rng.randint(50, 700)
        cap = rng.choice([None, 3])
        plan = plan_microbatches(lengths, budget, cap)
        flat = sorted(i for mb in plan for i in mb)
        assert flat == list(range(len(lengths)))
        for mb in plan:
            assert sum(lengths[i] for i in mb) <= budget or len(mb) == 1
            assert cap is None or len(mb) <= cap


def test_grouped_plan_keeps_a_prompts_sequences_together():
    a, b, c = [1] * 4, [2] * 2, [3] * 10  # prompts of 4, 2 and 10 tokens
    prompts = [a, b, a, c, a, b]
    responses = [5, 4, 3, 2, 6, 4]
    # a: 4 + 5 + 3 + 6 = 18 tokens packed once, b: 10, c: 12; first-fit decreasing in 20
    assert plan_grouped_microbatches(prompts, responses, 20) == [[0, 2, 4], [1, 5], [3]]
    # in 12, a splits where it outgrows the budget: [0, 2] (4 + 5 + 3) and [4] (4 + 6)
    assert plan_grouped_microbatches(prompts, responses, 12) == [[0, 2], [1, 5], [3], [4]]
    # two sequences at most: a splits into [0, 2] (12) and [4] (10), and neither fits beside c's 12
    assert plan_grouped_microbatches(prompts, responses, 20, max_sequences=2) == [[0, 2], [1, 5], [3], [4]]
    assert plan_grouped_microbatches(prompts, responses, 24, max_sequences=2) == [[0, 2], [1, 5], [3, 4]]
