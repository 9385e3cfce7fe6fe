"""Speculative decoding building blocks (issue 46), free of engine state: the n-gram
(prompt lookup) proposer, which proposes draft tokens on the host from a request's own
token history (:mod:`tandem.spec_decode.ngram_proposer`), and the rejection sampler, which
verifies a batch of draft tokens against the target model's probabilities on the device
and emits, per request, the accepted drafts followed by one recovered or bonus token, so
that the emitted tokens follow exactly the target distribution
(:mod:`tandem.spec_decode.rejection_sampler`)."""
