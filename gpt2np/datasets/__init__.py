"""Data: token shards and their loader, downloads and their cache, corpora, HellaSwag."""
