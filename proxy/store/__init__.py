"""Summary store: pay for each summary once, keep the forwarded prefix stable."""
