

def _nbytes(cache) -> int:
    """Key / value bytes a DynamicCache holds, from its tensors."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize("router", ["round_robin", "key_cluster"])
@pytest.mark.parametrize("shards", [1, 8, 16])
@pytest.mark.parametrize("page", [4, 16, 64])
def test_7_an_eviction_ratio_is_honoured_in_bytes_across_shards_and_pages(page, shards, router):
    """H2OPress(0.5) frees half the bytes whatever the shards and pages: a PiKVCache holds what a DynamicCache under
    the same press holds (its tensors' bytes) plus at most one partly filled page per layer, row and KV head (the
    shards' partly filled pages are pooled; before, with 16 shards of pages of 64, half of the tokens kept every
    page)."""
    model = tiny_model("llama", seed=0)
    ids = torch.randint(3, 256, (1, 300), generator=torch.Generator().manual_seed(3))
    dense, cache = DynamicCache(), PiKVCache(model, page_size=page, num_shards=shards, router=router)
    with torch.no_grad(), H2OPress(0.5)(model):
        model(ids, past_key_values=dense)
        model(ids, past_key_values=cache)
    want = _nbytes(dense)
    page_bytes = [layer.store.kv_nbytes() // layer.store.pool.num_pages for layer in cache.layers]
    slack = sum(b * layer.store.batch * layer.store.heads for b, layer in zip(page_bytes, cache.layers, strict=True))
    assert want <= cache.kv_nbytes() <= want + slack
    for layer, ref in zip(cache.layers, dense.layers, strict=True):  # the same tokens, now in fewer pages
        view = layer.view()
        assert torch.equal(view.keys, ref.keys) and torch.equal(view.values, ref.values)
