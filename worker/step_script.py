"""One engine step's writes as one Lua script: atomic, fenced by entry ownership, failing per request.

Why a script and not MULTI/EXEC:

- **Fencing.** A worker that stalled past the claim time (a long GC pause, SIGSTOP, a frozen VM)
  wakes up still believing it runs requests another worker has taken over. Every write for a
  request is conditional on the request's entry still being pending *for this consumer*, checked
  inside the script, so the check and the writes are one atomic step: once another worker claims
  the entry, nothing the stale one sends reaches the client or the progress record.
- **One bad reply address fails one request.** A PUBLISH or XADD the server refuses (an ACL that
  forbids the producer's reply key, a key of another type) is caught with `redis.pcall`; that
  request is acknowledged and dead-lettered (`reply_denied`) by the script, and the other
  requests of the step go on. A MULTI/EXEC aborts whole on a refused command.
- **Idempotent retries.** The script records the step's number under `lmq:applied:<consumer>`; a
  retry after a lost reply (the script ran, the connection broke before its answer) finds the
  number and writes nothing twice. Progress is written with SETRANGE at its token offset, which
  is idempotent on its own.

Per entry the script answers one status: `ok` (owned and written), `lost` (another consumer owns
it now: nothing written), `orphan` (pending for nobody — the group was lost or the entry already
acknowledged: events still go out, so a client whose request outlived a Redis flush gets its
answer), or `denied` (the reply write was refused; the entry is acknowledged and dead-lettered).
Only non-`ok` statuses are returned, as a flat list `record, status, detail, ...` (record: the
entry's 1-based position among the records, since two streams may hold entries of the same id).
A channel's events go in as few PUBLISHes as keep each message within the message limit (ARGV[7],
protocol.MAX_MESSAGE_BYTES less a batch's header): a gateway refuses a larger message whole, and
with it every request's events of the step. The publisher keeps each single event within it.
On a Redis Cluster a reply channel of kind `spubsub` (sharded pub/sub, SPUBLISH) or a reply stream
must lie in the script's slot; the worker checks that when it reads the request.

Arguments: KEYS = [dead-letter stream, applied-step key, then the request streams the entries come
from (a worker serves one per priority)]; ARGV = [group, consumer, step number, key TTL, reply
stream MAXLEN, dead-letter MAXLEN, the most event bytes one PUBLISH may carry, then one record per entry: its stream (a 1-based position among
the request streams of KEYS), entry id, reply kind (pubsub | spubsub | stream | ""), reply key, event count, the events (msgpack bytes),
progress key ("" = none), holder key ("" = none), progress byte offset, progress bytes, finish
("1" | "": acknowledge the entry, delete progress and holder), dead letter
("1" | ""), and when a dead letter: its msg, code and message].

A published batch is the msgpack of `protocol.encode_event_batch`, put together from the events'
own bytes: the map's header up to the `events` array is taken from that encoder, so it follows the
protocol's version, and the array's header (`ARRAY_HEADER_LUA`) is held to msgpack's own by
tests/worker/test_step_script.py.
"""

from __future__ import annotations

from protocol import encode_event_batch

# msgpack of {"v": VERSION, "events": []}, less its last byte (the empty array's header).
_BATCH_PREFIX = encode_event_batch([])[:-1]
if encode_event_batch([])[-1:] != b"\x90":
    raise RuntimeError("a batch's map must end with its events array, where the script appends the events")

ARRAY_HEADER_LUA = r"""
local function array_header(n)
  if n < 16 then return string.char(0x90 + n) end
  if n < 65536 then return string.char(0xdc, math.floor(n / 256), n % 256) end
  return string.char(0xdd, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
end
"""

LUA = (
    ARRAY_HEADER_LUA
    + "local batch_prefix = '"
    + "".join(f"\\{byte:03d}" for byte in _BATCH_PREFIX)
    + "'\n"
    + r"""
local dead_stream, applied_key = KEYS[1], KEYS[2]
local group, me, step, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local reply_maxlen, dead_maxlen, message_limit = ARGV[5], ARGV[6], tonumber(ARGV[7])

local last = tonumber(redis.call('GET', applied_key) or '-1')
if last >= step then return {} end
redis.call('SET', applied_key, step, 'EX', ttl)

local function owner(stream, entry)
  local pending = redis.pcall('XPENDING', stream, group, entry, entry, 1)
  if type(pending) ~= 'table' or pending.err or #pending == 0 then return nil end
  return pending[1][2]
end

local function failed(result)
  if type(result) == 'table' and result.err then return result.err end
  return nil
end

-- Read the records.
local records, i = {}, 8
while i <= #ARGV do
  local r = {stream = KEYS[2 + tonumber(ARGV[i])], entry = ARGV[i + 1], kind = ARGV[i + 2], key = ARGV[i + 3], events = {}}
  local n = tonumber(ARGV[i + 4])
  for j = 1, n do r.events[j] = ARGV[i + 4 + j] end
  i = i + 5 + n
  r.progress_key, r.holder_key, r.progress_at, r.progress = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
  r.finish, r.dead = ARGV[i + 4] == '1', ARGV[i + 5] == '1'
  i = i + 6
  if r.dead then r.dead_msg, r.dead_code, r.dead_text = ARGV[i], ARGV[i + 1], ARGV[i + 2]; i = i + 3 end
  r.position = #records + 1
  local who = owner(r.stream, r.entry)
  if who == me then r.status = 'ok' elseif who then r.status = 'lost' else r.status = 'orphan' end
  r.owned = r.status == 'ok'
  records[#records + 1] = r
end

-- Events: one PUBLISH (SPUBLISH for sharded pub/sub) per channel ({"v": 1, "events": [...]}), one XADD per event on reply streams.
local channels, channel_order = {}, {}
for _, r in ipairs(records) do
  if r.status ~= 'lost' and #r.events > 0 then
    if r.kind == 'pubsub' or r.kind == 'spubsub' then
      local c = channels[r.kind .. ' ' .. r.key]
      if not c then
        c = {command = r.kind == 'spubsub' and 'SPUBLISH' or 'PUBLISH', key = r.key, events = {}, records = {}}
        channels[r.kind .. ' ' .. r.key] = c; channel_order[#channel_order + 1] = r.kind .. ' ' .. r.key
      end
      for _, e in ipairs(r.events) do c.events[#c.events + 1] = e end
      c.records[#c.records + 1] = r
    elseif r.kind == 'stream' then
      for _, e in ipairs(r.events) do
        local err = failed(redis.pcall('XADD', r.key, 'MAXLEN', '~', reply_maxlen, '*', 'msg', e))
        if err then r.status, r.detail = 'denied', err; break end
      end
      if r.status ~= 'denied' then redis.pcall('EXPIRE', r.key, ttl) end
    end
  end
end
local function publish(c, first, last)
  local batch = batch_prefix .. array_header(last - first + 1) .. table.concat(c.events, '', first, last)
  local err = failed(redis.pcall(c.command, c.key, batch))
  if err then for _, r in ipairs(c.records) do r.status, r.detail = 'denied', err end end
end
for _, name in ipairs(channel_order) do
  local c = channels[name]
  local first, size = 1, 0
  for k, e in ipairs(c.events) do
    if size + #e > message_limit and k > first then publish(c, first, k - 1); first, size = k, 0 end
    size = size + #e
  end
  publish(c, first, #c.events)
end

-- Progress, acknowledgements, dead letters.
local answer = {}
for _, r in ipairs(records) do
  if r.status == 'denied' and not r.owned then
    r.finish = false  -- denied before, in an earlier step: already acknowledged and dead-lettered
  elseif r.status == 'denied' then
    local entry = redis.pcall('XRANGE', r.stream, r.entry, r.entry)
    local msg = ''
    if type(entry) == 'table' and entry[1] then
      local fields = entry[1][2]
      for k = 1, #fields, 2 do if fields[k] == 'msg' then msg = fields[k + 1] end end
    end
    redis.pcall('XADD', dead_stream, 'MAXLEN', '~', dead_maxlen, '*', 'msg', msg, 'code', 'reply_denied', 'message', 'the reply address could not be written: ' .. r.detail, 'worker', me)
    r.finish = true
  elseif r.status ~= 'lost' then
    if r.progress_key ~= '' and #r.progress > 0 then
      redis.pcall('SETRANGE', r.progress_key, r.progress_at, r.progress)
      redis.pcall('EXPIRE', r.progress_key, ttl)
    end
    if r.dead then
      redis.pcall('XADD', dead_stream, 'MAXLEN', '~', dead_maxlen, '*', 'msg', r.dead_msg, 'code', r.dead_code, 'message', r.dead_text, 'worker', me)
    end
  end
  if r.finish and r.status ~= 'lost' then
    redis.pcall('XACK', r.stream, group, r.entry)
    redis.pcall('XDEL', r.stream, r.entry)
    if r.progress_key ~= '' then redis.pcall('DEL', r.progress_key) end
    if r.holder_key ~= '' then redis.pcall('DEL', r.holder_key) end
  end
  if r.status ~= 'ok' then
    answer[#answer + 1] = r.position
    answer[#answer + 1] = r.status
    answer[#answer + 1] = r.detail or ''
  end
end
return answer
"""
)

KEEP_LUA = r"""
-- Reset the idle time of the entries this consumer still owns; answer the ones it no longer owns.
local stream, group, me = KEYS[1], ARGV[1], ARGV[2]
local lost = {}
for i = 3, #ARGV do
  local pending = redis.pcall('XPENDING', stream, group, ARGV[i], ARGV[i], 1)
  if type(pending) == 'table' and not pending.err and #pending == 1 then
    if pending[1][2] == me then
      redis.call('XCLAIM', stream, group, me, 0, ARGV[i], 'JUSTID')
    else
      lost[#lost + 1] = ARGV[i]
    end
  end
end
return lost
"""
