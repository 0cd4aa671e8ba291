-- wrk script: POST the JSON body of the file $KVB_BODY, each request with the API key
-- $KVB_KEY_PREFIX<i>, i drawn at random from 0 .. $KVB_KEYS - 1; then print one
-- machine-readable summary line (as benches/load/post.lua does).
local f = assert(io.open(os.getenv("KVB_BODY"), "rb"))
local body = f:read("*a")
f:close()
local keys = tonumber(os.getenv("KVB_KEYS"))
local prefix = os.getenv("KVB_KEY_PREFIX")
local headers = {["Content-Type"] = "application/json"}

init = function(args)
  math.randomseed(os.time())
end

request = function()
  headers["Authorization"] = "Bearer " .. prefix .. math.random(0, keys - 1)
  return wrk.format("POST", nil, headers, body)
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'KVB {"requests":%d,"duration_us":%d,"status_errors":%d,"connect":%d,"read":%d,' ..
    '"write":%d,"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
