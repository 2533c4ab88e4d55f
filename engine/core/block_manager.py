"""The paged KV cache's bookkeeping: block tables, reference counts and prefix caching."""

from collections import OrderedDict

from engine.core.sequence import Sequence, SequenceBlocks

BlockKey = tuple[int | None, tuple[int | str, ...]]  # (parent key's hash, token ids and image hashes)


class Block:
    """One fixed-size slab of KV cache. `key` is set once the block is full and computed."""

    __slots__ = ("block_id", "ref_count", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: BlockKey | None = None


class BlockManager:
    """Hands out KV-cache blocks to sequences.

    Blocks are reference counted, so sequences with a common prefix share them. With prefix
    caching a full block is keyed by (hash of its parent block's key, its token ids): equal
    keys mean equal contents, because the chain pins the whole prefix. The first block's
    parent is the request's LoRA adapter id (None for the base model), so requests with
    different adapters never share cached keys and values. A freed block keeps
    its key and waits in the free queue, reusable until it is handed out again, least
    recently freed first; blocks that hold nothing reusable are handed out before those.
    A block holding image tokens adds the images' content hashes to its token ids: every
    image has the same placeholder ids, so two prompts share such a block only when their
    images are the same.

    An encoder-decoder sequence (Whisper) also holds `cross` blocks for its encoder rows'
    cross-attention keys and values, from the same pool (vLLM's `CrossAttentionManager` over one
    block pool): taken with its first blocks, all or none; shared with its forks (written once,
    so never copied); freed with the rest. Its decoder blocks are never cached or found as a
    prefix: their keys and values depend on its clip, which the token ids do not show, and
    a hit would skip the step that writes the cross blocks (vLLM disables prefix caching for
    encoder-decoder models too).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[BlockKey, int] = {}
        self.num_evicted_blocks = 0
        # (source, destination) block copies that must happen before the next step's writes,
        # and the first block-table entry each copy replaced, by sequence.
        self.pending_copies: list[tuple[int, int]] = []
        self.rewritten_tables: dict[Sequence, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def _block_key(self, seq: Sequence, index: int) -> BlockKey:
        """Key of the sequence's `index`-th block, computing the chain up to it once."""
        size = self.block_size
        while len(seq.blocks.keys) <= index:
            i = len(seq.blocks.keys)
            parent = hash(seq.blocks.keys[i - 1]) if i else seq.lora_int_id
            tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
            images = tuple(f.identifier for f in seq.mm_features if f.offset < (i + 1) * size and f.end > i * size)
            seq.blocks.keys.append((parent, tokens + images))
        return seq.blocks.keys[index]

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """The longest run of cached blocks that starts the sequence, touching nothing.

        The last token is always left to compute, because its logits give the next token.
        """
        if not self.enable_prefix_caching or seq.cross_rows:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.cached_blocks.get(self._block_key(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Gives `seq` the blocks to hold `num_new_tokens` more tokens, or changes nothing.

        `cached_blocks` (from `find_cached_blocks`, only when the sequence is admitted)
        become the head of its block table. A partial last block shared with a forked
        sibling is copied before the sequence writes into it (copy on write). A sequence
        with encoder rows for cross-attention and no cross blocks yet takes those too.
        Returns False when too few blocks are free.
        """
        size = self.block_size
        if not cached_blocks and seq.num_computed_tokens + num_new_tokens <= len(seq.blocks.table) * size:
            # The common decode step: room in the last block, which is its own (or is
            # only entered now, at a block boundary, and needs no copy).
            offset = seq.num_computed_tokens % size
            if not offset or self.blocks[seq.blocks.table[seq.num_computed_tokens // size]].ref_count == 1:
                return True
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        num_blocks_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_blocks_needed - len(seq.blocks.table) - len(cached_blocks)
        num_reclaimed = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        copy_last = (
            num_computed % self.block_size != 0
            and num_computed < len(seq.blocks.table) * self.block_size
            and self.blocks[seq.blocks.table[num_computed // self.block_size]].ref_count > 1
        )
        num_cross = -(-seq.cross_rows // size) if not seq.blocks.cross else 0
        if max(num_new_blocks, 0) + num_reclaimed + copy_last + num_cross > len(self.free_queue):
            return False
        seq.blocks.cross += [self._take_free_block() for _ in range(num_cross)]
        if copy_last:
            index = num_computed // self.block_size
            shared = self.blocks[seq.blocks.table[index]]
            shared.ref_count -= 1
            seq.blocks.table[index] = self._take_free_block()
            self.rewritten_tables[seq] = min(self.rewritten_tables.get(seq, index), index)
            self.pending_copies.append((shared.block_id, seq.blocks.table[index]))
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        if cached_blocks:
            seq.blocks.table.extend(cached_blocks)
            seq.blocks.num_registered = len(seq.blocks.table)
        for _ in range(max(num_new_blocks, 0)):
            seq.blocks.table.append(self._take_free_block())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Lets `child` share every block of `parent` (a new completion of the same prompt),
        its cross blocks included."""
        for block_id in (*parent.blocks.table, *parent.blocks.cross):
            self.blocks[block_id].ref_count += 1
        child.blocks = SequenceBlocks(list(parent.blocks.table), list(parent.blocks.cross),
                                      parent.blocks.num_registered, list(parent.blocks.keys))

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:
            if self.cached_blocks.get(block.key) == block_id:
                del self.cached_blocks[block.key]
            block.key = None
            self.num_evicted_blocks += 1
        block.ref_count = 1
        return block_id

    def register_full_blocks(self, seq: Sequence) -> None:
        """Makes the sequence's newly computed full blocks findable by later requests."""
        # Only blocks whose tokens are all known: a token still being sampled may be
        # computed already (asynchronous scheduling), but it cannot be hashed yet.
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        if num_full <= seq.blocks.num_registered or not self.enable_prefix_caching or seq.cross_rows:
            return
        for i in range(seq.blocks.num_registered, num_full):
            block = self.blocks[seq.blocks.table[i]]
            if block.key is None:
                block.key = self._block_key(seq, i)
                self.cached_blocks.setdefault(block.key, block.block_id)
        seq.blocks.num_registered = max(seq.blocks.num_registered, num_full)

    def free(self, seq: Sequence) -> None:
        """Releases the sequence's blocks, its last block first so that it is evicted first
        (its cross blocks, which hold nothing reusable, before them)."""
        for block_id in (*reversed(seq.blocks.table), *seq.blocks.cross):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than it was taken")
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.key is None:
                    self.free_queue.move_to_end(block_id, last=False)
        seq.blocks.table = []
        seq.blocks.cross = []
        seq.blocks.num_registered = 0

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; only possible while no block is in use."""
        if len(self.free_queue) != len(self.blocks):
            return False
        for block in self.blocks:
            block.key = None
        self.cached_blocks.clear()
        return True
