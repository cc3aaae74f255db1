"""The paged KV cache: the pools of pages, the block manager (block tables, prefix caching), and attention
over pages."""
