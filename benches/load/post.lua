-- wrk script: POST the JSON body read from the file named by $KVB_BODY, then print one
-- machine-readable summary line (requests, duration, errors, latency percentiles in µs).
local f = assert(io.open(os.getenv("KVB_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'KVB {"requests":%d,"duration_us":%d,"status_errors":%d,"connect":%d,"read":%d,' ..
    '"write":%d,"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
