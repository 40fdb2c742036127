"""What is on storage: the leaf that writing, resolving and reading share; it imports none of them."""
