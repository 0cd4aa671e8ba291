#!lua name=kvgate
-- kvgate's limits shared by several gateway replicas (Redis / Valkey Functions, Redis >= 7.0).
--
-- One scope (a tenant, or a backend) lives under one hash tag, so every key a call touches is in
-- one Redis Cluster slot:
--   KEYS[1] = {<prefix>:<t|b>:<name>}          HASH  the scope's state (fields below)
--   KEYS[2] = {<prefix>:<t|b>:<name>}:live     ZSET  replica id -> lease expiry (server µs)
--   KEYS[3] = {<prefix>:<t|b>:<name>}:op:<id>  the operation id (a name only: never written)
-- State fields:
--   epoch                 random id written when the state is created (a changed epoch tells the
--                         replicas that Redis lost the scope: restart without persistence, flush)
--   seq|<pod>             the replica's last applied sequence number for this scope
--   q|<pool>|<pod>        units (slots or tokens) of <pool> held by the replica: its quota
--   alloc|<pool>          sum of the replicas' quotas of <pool>
--   alloc|*g              sum of alloc|<pool> over the scope's guarantee pools (named g:<tenant>):
--                         units a guarantee holds beyond what it is now (a reload lowered, moved
--                         or removed it while its requests ran) leave the burst pool less room
--   held|<pod>            the pools the replica holds quota in (cjson list; used to reap it)
--   tat|<bucket>          GCRA theoretical arrival time of a token bucket (server µs, float)
--   prop|<pod>, shed|<pod>  the replica's proposed adaptive scale (0..1) and shedding flag
--   op|<pod>, rep|<pod>   the operation id of the replica's last applied message and its reply
--                         (a repeated delivery of that operation gets the same reply)
--   reaped                replicas reaped in this scope (a counter)
--   heard                 when the scope last applied a message (server µs)
--   moved                 cjson {replica: n}: leases moved on by n silences of the scope since
--                         that replica last spoke (see `heard` in kvg_sync); at most MAX_MOVES
--   kept                  when the keys' expiry was last pushed back (server µs)
--   settle                until when nothing is granted or admitted (server µs): the scope was
--                         lost and the replicas re-assert their quotas
--
-- One function, kvg_sync, carries everything a replica says to a scope (JSON in ARGV[1], the
-- operation id as KEYS[3], a key name in the scope's slot that is never written — the form
-- every kvgate replica sends, which an earlier version of this library stored the reply under —
-- or in ARGV[2]):
--   pod, seq, ttl (µs), epoch (a candidate, used only when the state is created),
--   known            (the epoch the replica last saw for the scope; absent for a new one)
--   scale, shed      (backend scopes: this replica's proposal; absent for tenants)
--   pools  {name: {l = base limit, k = kind, q = the replica's quota now, gs, g}}
--          kinds: "p" plain (tenant concurrency), "s" scaled by the effective scale (in-flight
--          token budget), "t" scaled total slots, "b" burst pool = scaled total - sum of the
--          guarantees gs, "g" one tenant's guarantee g (shrunk in proportion when the scaled
--          total is below gs)
--          st = units of a plain pool held as standing slices (kept out of its limit)
--   buckets {name: {r = tokens/min, b = burst, sc = 1 when scaled, ret = tokens given back,
--           debt = overrun tokens to charge, sr, sb = the standing slices' rate and burst}}
--   grants  {name: wanted units}            partial grants allowed (at least 1)
--   admits  [{p = [[n, pool, pool...], ...], b = {bucket: n}}]  each all-or-nothing, in order;
--           a pool list is tried in order (a tenant's guarantee, then the burst pool)
-- and answers (JSON): epoch, stale, live, scale, shed, reaped, settling (true while the scope
-- settles after Redis lost it), pools {name: [q, alloc, limit]},
-- buckets {name: [available tokens, burst]}, grants {name: taken}, admits [[ok, refusing name,
-- retry_after µs, chosen pools...]].
-- kvg_sync_many carries several scopes' messages in one call (a replica's heartbeats on a
-- single server): each applied as kvg_sync applies it, the replies in order.
--
-- Rules: time is the server's (TIME), never a client's. A message whose seq is not above the
-- stored one is stale (a late delivery of a call that already timed out on the replica) and
-- changes nothing. Every message re-asserts the replica's quotas: q|<pool>|<pod> := q and alloc
-- moves by the difference — lowering q is how a replica gives units back, and the same rule
-- heals what a lost write, a timed-out call or a restart of Redis left behind. Grants and
-- admits never take alloc above the effective limit; re-assertion may (a replica that was
-- reaped while frozen and comes back with requests in flight): then nothing grows until it
-- drains. Dead replicas (lease expired) are reaped, at most 8 per call: their quotas go back.
-- A silence of the whole scope moves each running lease on, at most MAX_MOVES times before its
-- replica speaks again (see `heard` in kvg_sync).

-- how many silences of a scope may move one replica's lease on before it speaks again
local MAX_MOVES = 3

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function num(v)
  if v then return tonumber(v) end
  return 0
end

local function fmt(x)
  return string.format('%.3f', x)
end

-- an integer as Redis stores it (a plain Lua number could be written as 1e+15)
local function int(x)
  return string.format('%d', x)
end

local function reap(state, live, now)
  local dead = redis.call('ZRANGEBYSCORE', live, '-inf', now, 'LIMIT', 0, 8)
  for _, pod in ipairs(dead) do
    local held = redis.call('HGET', state, 'held|' .. pod)
    if held then
      for _, pool in ipairs(cjson.decode(held)) do
        local q = num(redis.call('HGET', state, 'q|' .. pool .. '|' .. pod))
        if q ~= 0 then
          redis.call('HINCRBY', state, 'alloc|' .. pool, -q)
          -- (absent, the sum is made again from the quotas when next needed)
          if pool:sub(1, 2) == 'g:' and redis.call('HEXISTS', state, 'alloc|*g') == 1 then
            redis.call('HINCRBY', state, 'alloc|*g', -q)
          end
        end
        redis.call('HDEL', state, 'q|' .. pool .. '|' .. pod)
      end
    end
    redis.call('HDEL', state, 'held|' .. pod, 'seq|' .. pod, 'prop|' .. pod, 'shed|' .. pod,
               'op|' .. pod, 'rep|' .. pod)
    redis.call('ZREM', live, pod)
    redis.call('HINCRBY', state, 'reaped', 1)
  end
  return #dead
end

-- the units every live replica holds in the scope's guarantee pools (g:<tenant>), from the
-- pools each one holds quota in
local function guarantee_units(state, live)
  local sum = 0
  for _, pod in ipairs(redis.call('ZRANGE', live, 0, -1)) do
    local held = redis.call('HGET', state, 'held|' .. pod)
    if held then
      local fields = {}
      for _, pool in ipairs(cjson.decode(held)) do
        if pool:sub(1, 2) == 'g:' then fields[#fields + 1] = 'q|' .. pool .. '|' .. pod end
      end
      -- (in reads of at most 1,000 fields: Lua's stack bounds what unpack may spread)
      for i = 1, #fields, 1000 do
        local vals = redis.call('HMGET', state, unpack(fields, i, math.min(i + 999, #fields)))
        for _, q in ipairs(vals) do sum = sum + num(q) end
      end
    end
  end
  return sum
end

local function effective_scale(state, live, msg)
  -- the most conservative live proposal (this replica's included)
  local s, shed = 1.0, false
  local pods = redis.call('ZRANGE', live, 0, -1)
  local fields = {}
  for _, pod in ipairs(pods) do
    fields[#fields + 1] = 'prop|' .. pod
    fields[#fields + 1] = 'shed|' .. pod
  end
  if #fields == 0 then return s, shed, 0 end
  local vals = redis.call('HMGET', state, unpack(fields))
  for i = 1, #fields, 2 do
    if vals[i] then s = math.min(s, tonumber(vals[i])) end
    if vals[i + 1] == '1' then shed = true end
  end
  return s, shed, #pods
end

local function pool_limit(p, s)
  local kind = p.k or 'p'
  local base = p.l
  -- st: the standing slices of every replica that may hold one (kvg_stand), kept out of what
  -- Redis grants and admits
  if kind == 'p' then return math.max(0, base - (p.st or 0)) end
  local total = base
  if total > 0 and s < 1 then total = math.max(1, math.floor(total * s + 1e-9)) end
  if kind == 's' or kind == 't' then return total end
  local gs = p.gs or 0
  if kind == 'b' then return math.max(0, total - gs) end
  if total >= gs or gs == 0 then return p.g or 0 end
  return math.floor((p.g or 0) * total / gs)
end

-- a token bucket (GCRA): one float, the theoretical arrival time; `interval` µs per token
local function bucket_params(b, s)
  -- sr, sb: the rate and burst of the standing slices (kvg_stand), kept out of the bucket
  local rate, burst = math.max(1, b.r - (b.sr or 0)), math.max(1, b.b - (b.sb or 0))
  if b.sc == 1 and s < 1 then
    rate = math.max(1, math.floor(rate * s + 1e-9))
    burst = math.max(1, math.floor(burst * s + 1e-9))
  end
  local interval = 60e6 / rate
  return interval, burst, burst * interval
end

local function bucket_available(tat, now, interval)
  return math.floor((now - tat) / interval + 1e-6)
end

-- fields read in one HMGET: returns a table name -> value (false when absent)
local function hmget(state, names)
  if #names == 0 then return {} end
  local vals = redis.call('HMGET', state, unpack(names))
  local out = {}
  for i, name in ipairs(names) do out[name] = vals[i] end
  return out
end

local function kvg_sync(keys, args)
  local state, live, op = keys[1], keys[2], args[2]
  -- the operation named by a third key (what replicas send, so that an earlier version of this
  -- library, which stores the reply under that key, serves them too): never written here
  if keys[3] then op = keys[3] end
  if not op then
    return redis.error_reply('ERR kvg_sync: no operation id (KEYS[3] or ARGV[2])')
  end
  local msg = cjson.decode(args[1])
  local pod = msg.pod
  local head = redis.call('HMGET', state, 'epoch', 'seq|' .. pod, 'heard', 'settle',
                          'op|' .. pod, 'rep|' .. pod, 'kept', 'moved')
  -- a repeated delivery of the replica's last operation: its first reply, nothing applied again
  if head[5] == op and head[6] then return head[6] end
  local now = now_us()
  local reply = {}
  -- every write of the call goes in one HSET at the end (`out`), the deletions in one HDEL
  local out, del = {}, {}
  local epoch = head[1]
  local settle = tonumber(head[4] or '0')
  if not epoch then
    epoch = msg.epoch
    redis.call('HSET', state, 'epoch', epoch)
    if msg.known then
      -- the sender knew this scope: Redis lost it (restart or flush without persistence).
      -- Nothing is granted or admitted until the replicas holding quotas have re-asserted them
      -- (they speak every heartbeat, at most half a lease): else the first one back could be
      -- granted what the others still run
      settle = now + msg.ttl / 2
      redis.call('HSET', state, 'settle', string.format('%.0f', settle))
    end
  end
  reply.epoch = epoch
  local last = num(head[2])
  if msg.seq <= last then
    reply.stale = true
    return cjson.encode(reply)
  end
  -- a scope that heard nothing for over half a lease (Redis away or refusing writes, or every
  -- replica quiet: live holders speak every heartbeat, at most half a lease) moves the leases
  -- that ran when it went quiet on by that silence: the first replica back must not reap the
  -- others, whose requests still run, for a silence that was Redis's. At most MAX_MOVES times
  -- per replica before it speaks again (a live one does within a heartbeat of Redis's return,
  -- even when Redis flaps): a dead replica is still reaped in a scope whose every message
  -- follows such a silence (a quiet tenant whose client retries every few seconds). The
  -- sender's own lease moves too (it is renewed below, after reaping), never counted
  local heard = tonumber(head[3] or '0')
  local moved = head[8] and cjson.decode(head[8]) or nil
  local moves_changed = false
  if moved and moved[pod] then
    moved[pod] = nil
    moves_changed = true
  end
  if heard > 0 and now - heard > msg.ttl / 2 then
    for _, other in ipairs(redis.call('ZRANGEBYSCORE', live, '(' .. fmt(heard), '+inf')) do
      local n = moved and moved[other] or 0
      if other == pod or n < MAX_MOVES then
        redis.call('ZINCRBY', live, now - heard, other)
        if other ~= pod then  -- the sender's own move is not counted
          moved = moved or {}
          moved[other] = n + 1
          moves_changed = true
        end
      end
    end
  end
  reply.reaped = reap(state, live, now)
  if moved then
    local left = false
    for other, _ in pairs(moved) do
      if not redis.call('ZSCORE', live, other) then
        moved[other] = nil  -- reaped, or left (an earlier library reaps without knowing it)
        moves_changed = true
      else
        left = true
      end
    end
    if moves_changed then
      if left then
        out[#out + 1] = 'moved'
        out[#out + 1] = cjson.encode(moved)
      else
        del[#del + 1] = 'moved'
      end
    end
  end
  -- written after reaping: reaping this replica itself (frozen past its lease) drops its fields
  out[#out + 1] = 'seq|' .. pod
  out[#out + 1] = int(msg.seq)
  out[#out + 1] = 'heard'
  out[#out + 1] = string.format('%.0f', now)
  local joined = redis.call('ZADD', live, now + msg.ttl, pod)
  -- keep the scope at least 180 s after each message (its buckets' state matters after its
  -- last replica left, and a replica tells a lost scope from an expired one by that time): the
  -- expiry is pushed back every 10 s at most, to 10 s more than that; and whenever this replica
  -- joined the live set (a set emptied by leaving or reaping is made again without an expiry),
  -- or `kept` lies ahead of the server's clock (a clock stepped back, a failover)
  local kept = tonumber(head[7] or '0')
  local recount = false  -- (alloc|*g made again from the quotas: below)
  if now - kept >= 10000000 or now < kept or joined == 1 then
    recount = true
    local keep_ms = math.floor(msg.ttl / 1000) * 4 + 190000
    redis.call('PEXPIRE', live, keep_ms)
    redis.call('PEXPIRE', state, keep_ms)
    out[#out + 1] = 'kept'
    out[#out + 1] = string.format('%.0f', now)
  end

  local s, shed, count = 1.0, false, nil
  if msg.scale then
    redis.call('HSET', state, 'prop|' .. pod, fmt(msg.scale), 'shed|' .. pod, msg.shed and '1' or '0')
    s, shed, count = effective_scale(state, live, msg)
  end
  reply.scale = s
  reply.shed = shed
  reply.live = count or redis.call('ZCARD', live)

  -- one read of every field the pools and buckets need (after reaping, which moves them)
  local pools, buckets = msg.pools or {}, msg.buckets or {}
  local names = {'held|' .. pod, 'alloc|*g'}
  for name, _ in pairs(pools) do
    names[#names + 1] = 'q|' .. name .. '|' .. pod
    names[#names + 1] = 'alloc|' .. name
  end
  for name, _ in pairs(buckets) do names[#names + 1] = 'tat|' .. name end
  local f = hmget(state, names)

  -- re-assert the replica's quotas, then compute the limits
  local limits, alloc, q = {}, {}, {}
  local held = {}
  -- the guarantee pools' units (alloc|*g) and each burst pool's scaled total: a burst pool
  -- lends only what the guarantees' units leave of the total, so that units a guarantee holds
  -- beyond what it is now (lowered, moved or removed by a reload while its requests ran)
  -- still count, as they do in one gateway's core
  local gdelta = 0
  local guarantee, totals = {}, {}
  for name, p in pairs(pools) do
    local rec = num(f['q|' .. name .. '|' .. pod])
    local want = p.q or 0
    alloc[name] = num(f['alloc|' .. name]) + (want - rec)
    q[name] = want
    limits[name] = pool_limit(p, s)
    if p.k == 'g' then
      guarantee[name] = true
      gdelta = gdelta + (want - rec)
    elseif p.k == 'b' then
      totals[name] = pool_limit({l = p.l, k = 't'}, s)
    end
  end
  local gsum = num(f['alloc|*g'])
  if next(guarantee) or next(totals) then
    if recount or not f['alloc|*g'] then
      -- the sum made again from the quotas Redis records (before this message's own), each
      -- time the scope's expiry is pushed back (every 10 s at most): a scope that never had
      -- it, or whose pools an earlier version of this library moved without it (a rolling
      -- upgrade), is right again within 10 s
      gsum = guarantee_units(state, live)
    end
    gsum = gsum + gdelta
  end
  -- units a pool can lend now (its limit, and for a burst pool the total the guarantees leave)
  local function room(name)
    local r = limits[name] - alloc[name]
    if totals[name] then r = math.min(r, totals[name] - gsum - alloc[name]) end
    return r
  end
  -- alloc of a pool moved by n (and the guarantees' sum with it)
  local function take(name, n)
    alloc[name] = alloc[name] + n
    if guarantee[name] then gsum = gsum + n end
  end

  local bstate = {}
  for name, b in pairs(buckets) do
    local interval, burst, fill = bucket_params(b, s)
    local tat = math.max(tonumber(f['tat|' .. name] or '0'), now - fill)
    if (b.ret or 0) > 0 then tat = math.max(tat - b.ret * interval, now - fill) end
    if (b.debt or 0) > 0 then tat = math.min(tat + b.debt * interval, now + fill) end
    bstate[name] = {tat = tat, interval = interval, burst = burst, fill = fill}
  end

  local settling = now < settle
  if settling then reply.settling = true end
  -- pass-through admissions, in arrival order, each all-or-nothing
  local admits = {}
  for i, a in ipairs(msg.admits or {}) do
    local ok, why, retry, chosen = true, '', 0, {}
    if settling then
      ok, retry = false, math.ceil(settle - now)
      if a.p and a.p[1] then why = a.p[1][#a.p[1]] end
      for name, _ in pairs(a.b or {}) do
        if why == '' then why = name end
      end
      a = {}  -- nothing below takes anything
    end
    for _, alt in ipairs(a.p or {}) do
      local n, pick = alt[1], nil
      for j = 2, #alt do
        local name = alt[j]
        if limits[name] and n <= room(name) then pick = name; break end
      end
      if not pick then ok, why = false, alt[#alt]; break end
      chosen[#chosen + 1] = pick
      take(pick, n)   -- tentative: undone below if a later check refuses
    end
    if ok then
      for name, n in pairs(a.b or {}) do
        local st = bstate[name]
        if n > 0 and st then
          local avail = bucket_available(st.tat, now, st.interval)
          if n > avail then
            ok, why = false, name
            retry = math.ceil(st.tat + n * st.interval - now)
            if n > st.burst then retry = -1 end
            break
          end
        end
      end
    end
    -- undo the tentative pool takes, then apply for real when admitted
    local k = 1
    for _, alt in ipairs(a.p or {}) do
      if chosen[k] then take(chosen[k], -alt[1]) end
      k = k + 1
    end
    if ok then
      k = 1
      for _, alt in ipairs(a.p or {}) do
        local name = chosen[k]
        take(name, alt[1])
        q[name] = q[name] + alt[1]
        k = k + 1
      end
      for name, n in pairs(a.b or {}) do
        local st = bstate[name]
        if st then st.tat = st.tat + n * st.interval end
      end
      admits[i] = {1, '', 0, chosen}
    else
      admits[i] = {0, why, retry, {}}
    end
  end
  reply.admits = admits

  -- background grants (partial)
  local grants = {}
  for name, want in pairs(msg.grants or {}) do
    local got = 0
    if settling then
      got = 0
    elseif limits[name] then
      got = math.max(0, math.min(want, room(name)))
      take(name, got)
      q[name] = q[name] + got
    elseif bstate[name] then
      local st = bstate[name]
      got = math.max(0, math.min(want, bucket_available(st.tat, now, st.interval)))
      st.tat = st.tat + got * st.interval
    end
    grants[name] = got
  end
  reply.grants = grants

  -- write back
  local out_pools = {}
  for name, _ in pairs(pools) do
    local field = 'q|' .. name .. '|' .. pod
    if q[name] ~= 0 then
      out[#out + 1] = field
      out[#out + 1] = int(q[name])
      held[#held + 1] = name
    else
      del[#del + 1] = field
    end
    out[#out + 1] = 'alloc|' .. name
    out[#out + 1] = int(alloc[name])
    local limit = limits[name]
    if totals[name] then limit = math.max(0, math.min(limit, totals[name] - gsum)) end
    out_pools[name] = {q[name], alloc[name], limit}
  end
  if (next(guarantee) or next(totals)) and (gsum ~= num(f['alloc|*g']) or not f['alloc|*g']) then
    out[#out + 1] = 'alloc|*g'
    out[#out + 1] = int(gsum)
  end
  -- a pool this message does not mention keeps its place while Redis records units of it for
  -- the replica (a late call's grant): reaping must give back every unit
  local before = f['held|' .. pod]
  if before then
    local others, fields = {}, {}
    for _, name in ipairs(cjson.decode(before)) do
      if not pools[name] then
        others[#others + 1] = name
        fields[#fields + 1] = 'q|' .. name .. '|' .. pod
      end
    end
    if #fields > 0 then
      local vals = redis.call('HMGET', state, unpack(fields))
      for i, name in ipairs(others) do
        if num(vals[i]) ~= 0 then held[#held + 1] = name end
      end
    end
  end
  if #held > 0 then
    out[#out + 1] = 'held|' .. pod
    out[#out + 1] = cjson.encode(held)
  else
    del[#del + 1] = 'held|' .. pod
  end
  local out_buckets = {}
  for name, st in pairs(bstate) do
    out[#out + 1] = 'tat|' .. name
    out[#out + 1] = fmt(st.tat)
    out_buckets[name] = {bucket_available(st.tat, now, st.interval), st.burst}
  end
  reply.pools = out_pools
  reply.buckets = out_buckets
  local encoded = cjson.encode(reply)
  out[#out + 1] = 'op|' .. pod
  out[#out + 1] = op
  out[#out + 1] = 'rep|' .. pod
  out[#out + 1] = encoded
  redis.call('HSET', state, unpack(out))
  if #del > 0 then redis.call('HDEL', state, unpack(del)) end
  return encoded
end

-- several scopes' messages in one call, each applied exactly as kvg_sync applies it alone (a
-- replica's heartbeats and give-backs, up to 32 at once; a single server only: the keys of
-- several scopes are in different Cluster slots). KEYS: three per scope, as kvg_sync takes
-- them; ARGV: one message per scope, in the same order. Answers the replies in that order (a
-- scope's error reply in its place).
local function kvg_sync_many(keys, args)
  if #keys ~= 3 * #args then
    return redis.error_reply('ERR kvg_sync_many: three keys per message')
  end
  local out = {}
  for i = 1, #args do
    out[i] = kvg_sync({keys[3 * i - 2], keys[3 * i - 1], keys[3 * i]}, {args[i]})
  end
  return out
end

-- a replica leaving cleanly (drain finished): its quotas go back at once
local function kvg_leave(keys, args)
  local state, live = keys[1], keys[2]
  local pod = args[1]
  -- a scope whose state expired (or was lost) holds nothing to give back; its state made
  -- again here by the count of reaped replicas would never expire
  if redis.call('EXISTS', state) == 0 then
    redis.call('ZREM', live, pod)
    return 0
  end
  redis.call('ZADD', live, 0, pod)
  return reap(state, live, now_us())
end

-- Standing slices: each of at most R replicas may hold, without any message, a slice of every
-- large tenant limit (st, sr and sb above keep R slices out of what Redis grants). A replica
-- may use its slices only while it holds one of the R claims of KEYS[1] (a HASH: i|<c> = the
-- replica, e|<c> = its claim's expiry or when it was given up, server µs; born = when the hash
-- was made; n = R; s = the share), renewed with each heartbeat. ARGV: pod, ttl µs, R, want
-- (the claim it held, or -1), leave ("1": give it up), share (the replica's standing_share, as
-- text; optional). Rules:
--   a claim is free once it expired a whole ttl ago (its replica stopped using it at the
--     expiry, by its own clock, and its requests have had a lease period to end), or at once
--     when its replica gave it up (stopping cleanly, after its drain);
--   a replica gets back the claim it held when that is free or still its own (Redis restarted
--     empty, or a failover lost the hash: the holders re-assert their claims first);
--   a replica without one gets the lowest free claim, but not before the hash is two ttl old
--     (so that every holder from before a loss has re-asserted its own);
--   a claim's tokens are the claim's, not the replica's: a replica that takes a claim another
--     held (or one the hash has no record of) is told how long the claim has gone unused
--     (since the expiry or the giving up, else since the hash was made), and its slices'
--     buckets start with only what they would have refilled meanwhile;
--   every replica must say the same R and share: a different one gets no claim (-2).
-- Answers {claim (-1: none, -2: R or share differs from the hash's), the claim's expiry - now (µs),
-- µs the claim went unused (-1: the replica kept its own)}.
local function kvg_stand(keys, args)
  local key, pod = keys[1], args[1]
  local ttl, n, leave = tonumber(args[2]), tonumber(args[3]), args[5]
  local want = tonumber(args[4]) or -1
  local share = args[6]
  local now = now_us()
  local h = {}
  local flat = redis.call('HGETALL', key)
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  local born = tonumber(h.born)
  if not born and leave == '1' then return {-1, 0, -1} end  -- nothing to give up: make no hash
  if not born then
    born = now
    redis.call('HSET', key, 'born', int(now), 'n', n)
  elseif not h.n then
    redis.call('HSET', key, 'n', n)
  elseif tonumber(h.n) ~= n and leave ~= '1' then
    return {-2, 0, -1}
  end
  if share then
    if not h.s then
      redis.call('HSET', key, 's', share)
    elseif h.s ~= share and leave ~= '1' then
      return {-2, 0, -1}
    end
  end
  local function free(c)
    local holder = h['i|' .. c]
    return not holder or holder == pod or (tonumber(h['e|' .. c]) or 0) + ttl < now
  end
  local mine = -1
  for c = 0, n - 1 do
    if h['i|' .. c] == pod then mine = c end
  end
  if leave == '1' then
    if mine >= 0 then
      redis.call('HDEL', key, 'i|' .. mine)
      redis.call('HSET', key, 'e|' .. mine, int(now))
    end
    return {-1, 0, -1}
  end
  if mine < 0 and want >= 0 and want < n and free(want) then mine = want end
  if mine < 0 and now >= born + 2 * ttl then
    for c = 0, n - 1 do
      if free(c) then
        mine = c
        break
      end
    end
  end
  redis.call('PEXPIRE', key, math.max(1000, math.floor(10 * ttl / 1000)))
  if mine < 0 then return {-1, 0, -1} end
  local holder, last = h['i|' .. mine], tonumber(h['e|' .. mine])
  local unused = -1
  -- its own claim, or the one it held before the hash was lost: its buckets stand
  if holder ~= pod and not (mine == want and not holder and not last) then
    unused = math.max(0, now - (last or born))
  end
  redis.call('HSET', key, 'i|' .. mine, pod, 'e|' .. mine, int(now + ttl))
  return {mine, math.floor(ttl), math.floor(unused)}
end

-- an operator's view of one scope (read-only)
local function kvg_peek(keys, args)
  local state, live = keys[1], keys[2]
  local now = now_us()
  local out = {now = now, fields = redis.call('HGETALL', state),
               live = redis.call('ZRANGE', live, 0, -1, 'WITHSCORES')}
  return cjson.encode(out)
end

redis.register_function('kvg_sync', kvg_sync)
redis.register_function('kvg_sync_many', kvg_sync_many)
redis.register_function('kvg_leave', kvg_leave)
redis.register_function('kvg_stand', kvg_stand)
redis.register_function{function_name = 'kvg_peek', callback = kvg_peek, flags = {'no-writes'}}
