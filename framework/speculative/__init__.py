"""Speculative decoding: proposers draft tokens, the target model verifies them in one forward.

``ngram`` drafts from a request's own prompt and output (prompt lookup); ``verify`` decides
which drafted tokens the target accepts, greedily or by rejection sampling, which keeps the
target's distribution exactly.
"""

from framework.speculative.ngram import NgramProposer
from framework.speculative.verify import Verdict, accept_greedy, verify_sampled

__all__ = ["NgramProposer", "Verdict", "accept_greedy", "verify_sampled"]
