"""PrefixCache: the KV of full blocks kept for the next request whose tokens begin the same way.

A full block's keys and values depend on its `block_size` tokens, on every token before them and on the adapter
that computed them (its registration: `adapter_tag`), on nothing else. So kept blocks form a trie per (tenant,
cache salt, adapter tag) whose edges are blocks' token ids (exact tuples: no hash can collide). A sequence admitted with
nothing computed takes the longest run of kept blocks its tokens begin with, all but its last token (whose logits
it needs), and computes only the rest; one asking for prompt logprobs takes none (they need every position's
logits). Tenants never share blocks: a hit would show in another tenant's time to first token what one had sent; nor do
requests of one tenant with different `cache_salt`s (vLLM's: a tenant serving several users keeps them apart).

Blocks come in as soon as a step that ran filled them (`grow`: a request arriving while another with the same
system prompt runs finds them), and when their sequence leaves the GPU (finished, or preempted: readmitted, it
finds them again); nothing a failed forward wrote is kept, nor the last blocks of a sequence that failed. A kept
block in use belongs to the page pool's `PREFIX` owner; once no sequence uses it, it is idle, which the pool
counts as free: allocations take plain free pages first, then idle ones, least recently idle first (a block's
descendants before itself), and the pool reports each (`on_evict`, on whichever thread allocated: adapter loads
run on their own). The trie drops those blocks, and their descendants, before its next lookup or grow, both
made on the engine's thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator

from lorafleet.worker.page_pool import PagePool
from lorafleet.worker.scheduled_batch import ScheduledBatch
from lorafleet.worker.sequence import Sequence


class Block:
    __slots__ = ("page", "parent", "tokens", "children", "refs")

    def __init__(self, page: int | None, parent: Block | None, tokens: tuple) -> None:
        self.page, self.parent, self.tokens = page, parent, tokens
        self.children: dict[tuple[int, ...], Block] = {}
        self.refs = 1  # sequences using it (its creator first)


class PrefixCache:
    def __init__(self, pool: PagePool, block_size: int) -> None:
        self.pool, self.block_size = pool, block_size
        self._roots: dict[tuple, Block] = {}  # (tenant, cache salt, adapter tag, tenant's era) -> root
        # A tenant's era: how many times its name left the keys file. Its blocks still in use then stay under the old
        # era's root, which no one given the name later reaches (drop_tenant). Written on any thread.
        self._eras: dict[str, int] = {}
        self._by_page: dict[int, Block] = {}
        self._evicted: deque[int] = deque()  # idle pages the pool gave away (appended on any thread)
        # (0, tenant) or (2, adapter tag) of roots gone: a tenant left the keys file, a registration was dropped
        # (appended on any thread)
        self._dropped: deque[tuple[int, Hashable]] = deque()
        pool.on_evict = self._evicted.append
        self.queried_tokens = self.hit_tokens = 0  # tokens admitted sequences looked up, and found computed
        # What an adapter's KV depends on (AdapterPool.content_tag: its registration); KeyError: keep nothing.
        self.adapter_tag: Callable[[str], Hashable] = lambda key: key

    @property
    def num_blocks(self) -> int:
        return len(self._by_page)

    def lookup(self, seq: Sequence) -> list[Block]:
        """The kept blocks `seq`'s tokens begin with (all but its last token), each now used by it once more."""
        self._drain()
        found = []
        for child in self._path(self._roots.get(self._root_key(seq)), seq, (seq.num_tokens - 1) // self.block_size):
            if child.refs == 0 and not self.pool.reuse(child.page):
                break  # given away since the drain (dropped at the next)
            child.refs += 1
            found.append(child)
        return found

    def _path(self, node: Block | None, seq: Sequence, count: int) -> Iterator[Block]:
        """The kept blocks under `node` that `seq`'s first `count` blocks of tokens run through, up to the first
        not kept."""
        bs = self.block_size
        for i in range(count if node is not None else 0):
            node = node.children.get(tuple(seq.tokens(i * bs, (i + 1) * bs)))
            if node is None:
                return
            yield node

    def filled_by_another(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """One of `batch`'s prefills fills a block of waiting `seq`'s tokens (a full block before its last token,
        the tokens before it the same, for the same tenant and adapter) that no lookup finds yet: `seq` finds it
        kept at the next step (`grow`) instead of computing it beside (the `n` choices of a request, a burst
        sharing a prompt). Only prefills of its trie beginning with its first block are looked at (`_fillers`)."""
        bs = self.block_size
        if not batch.prefills or seq.num_tokens <= bs or (key := self._root_key(seq)) is None:
            return False
        for i in self._fillers(batch).get((key, tuple(seq.tokens(0, bs))), ()):
            other, n = batch.prefills[i]
            end = (other.num_computed_tokens // bs + 1) * bs  # the first block its chunk fills
            if (other is not seq and end <= min(other.num_computed_tokens + n, seq.num_tokens - 1)
                    and other.token_at(end - 1) == seq.token_at(end - 1)
                    and other.tokens(0, end) == seq.tokens(0, end)  # copies: last (a burst sharing a prompt)
                    and not self._kept(key, seq, end)):
                return True
        return False

    def _fillers(self, batch: ScheduledBatch) -> dict[tuple, list[int]]:
        """The positions in `batch.prefills` by (root key, first block of tokens), what a sequence shares with any
        prefill that fills one of its blocks: each prefill added since the last call is indexed once, so a head is
        compared only with the prefills of its tenant, adapter and first block, not with every prefill of the step
        (quadratic in a burst of many tenants; a burst of one tenant's prompts beginning alike still compares
        each head with them all). The positions are read at each call: a chunk grown in place is seen as it is now.
        The root keys are those at indexing: a tenant or registration dropped meanwhile makes at worst a head
        compute a block beside a prefill once."""
        bs = self.block_size
        if batch.fillers is None:
            batch.fillers, batch.indexed = {}, 0
        assert batch.indexed <= len(batch.prefills), "prefills taken out of a step other than by remove()"
        for other, _ in batch.prefills[batch.indexed:]:
            if other.num_tokens >= bs and (key := self._root_key(other)) is not None:
                batch.fillers.setdefault((key, tuple(other.tokens(0, bs))), []).append(batch.indexed)
            batch.indexed += 1
        return batch.fillers

    def _kept(self, key: tuple, seq: Sequence, end: int) -> bool:
        """Whether the blocks of `seq`'s first `end` tokens are kept under `key` (its lookup finds them: another
        computing them again, a prefill asking for prompt logprobs, is no reason to wait)."""
        count = end // self.block_size
        return sum(1 for _ in self._path(self._roots.get(key), seq, count)) == count

    def grow(self, seq: Sequence) -> None:
        """`seq`'s full computed blocks past those it holds become kept blocks it holds (`seq.prefix_blocks`),
        found from now on by the sequences admitted while it runs. A block kept already (another sequence computed
        the same tokens) is shared instead: `seq`'s own page for it is freed. Stops at a kept block whose idle page
        went meanwhile, or when its adapter is gone (the rest stays its own)."""
        held, bs = seq.prefix_blocks, self.block_size
        if seq.num_computed_tokens // bs <= len(held):
            return
        self._drain()
        if held:
            node = held[-1]
        elif (key := self._root_key(seq)) is None:
            return
        else:  # a root's tokens: its key (to drop it once empty)
            node = self._roots.setdefault(key, Block(None, None, key))
        for i in range(len(held), seq.num_computed_tokens // bs):
            block_tokens, page = tuple(seq.tokens(i * bs, (i + 1) * bs)), seq.block_table[i]
            child = node.children.get(block_tokens)
            if child is None:
                child = node.children[block_tokens] = self._by_page[page] = Block(page, node, block_tokens)
                self.pool.keep(page)
            elif child.refs == 0 and not self.pool.reuse(child.page):
                return
            else:
                child.refs += 1
                self.pool.free([page])
                seq.block_table[i] = child.page
            held.append(child)
            node = child

    def _root_key(self, seq: Sequence) -> tuple | None:
        """(tenant, cache salt, adapter tag, tenant's era) of `seq`'s trie; None when its adapter is gone (nothing
        kept, nothing found)."""
        try:
            tag = None if seq.adapter is None else self.adapter_tag(seq.adapter)
        except KeyError:
            return None
        return seq.tenant, seq.params.cache_salt, tag, self._eras.get(seq.tenant, 0)

    def release(self, blocks: list[Block]) -> None:
        """A sequence no longer uses `blocks` (a path from the root): those nobody uses go idle, deepest first,
        so that they are given away before their ancestors."""
        for block in reversed(blocks):
            block.refs -= 1
            if block.refs == 0:
                self.pool.idle(block.page)

    def drop_tag(self, tag: Hashable) -> None:
        """The adapter registration `tag` (AdapterPool.content_tag) is gone: no sequence finds its blocks again, so
        those idle now become plain free pages at the next drain, before any other idle one is given away (its
        blocks still in use go idle as usual, taken after). Any thread."""
        self._dropped.append((2, tag))

    def drop_tenant(self, tenant: str) -> None:
        """`tenant` left the keys file: its blocks go as a dropped registration's (`drop_tag`), so that whoever is
        given its name later never finds them; those still in use stay under the root of the era that ends now,
        which no later request of the name reaches, also once they are idle. Any thread."""
        self._eras[tenant] = self._eras.get(tenant, 0) + 1
        self._dropped.append((0, tenant))

    def _drain(self) -> None:
        """Drop the blocks whose idle pages the pool gave away, with their descendants (unreachable now; idle too,
        as a sequence using one would use its ancestors), and the idle blocks of tenants and registrations gone."""
        while self._evicted:
            block = self._by_page.pop(self._evicted.popleft(), None)
            if block is None:
                continue  # dropped already, with an ancestor
            self._cut(block)
        while self._dropped:
            field, value = self._dropped.popleft()
            for root in [r for key, r in self._roots.items() if key[field] == value]:
                stack = [root]
                while stack:  # an idle block's descendants are idle: a sequence using one would use its ancestors
                    for child in list(stack.pop().children.values()):
                        if child.refs > 0:
                            stack.append(child)
                            continue
                        if self._by_page.get(child.page) is child:  # else given away already, drained next time
                            del self._by_page[child.page]
                            self.pool.forget(child.page)
                        self._cut(child)

    def _cut(self, block: Block) -> None:
        """`block`, dropped from the trie (its page already out of `_by_page`), and its descendants, whose idle
        pages become plain free; a root left empty goes."""
        del block.parent.children[block.tokens]
        if block.parent.page is None and not block.parent.children:
            del self._roots[block.parent.tokens]
        stack = list(block.children.values())
        while stack:
            child = stack.pop()
            if self._by_page.pop(child.page, None) is child:
                self.pool.forget(child.page)
            stack.extend(child.children.values())
