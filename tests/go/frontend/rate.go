package main

// The rate mode (tests/tests/integration/dial_retries.rs, bench --scenarios
// retries): single-use tunnels opened at a steady rate, whatever becomes of
// the ones before, as kube-apiserver opens one per webhook call.
//
//	rate -addr A -rate R -duration D [-exchange B] [-limit L] [-each]
//
// Every 1/R seconds for D, a tunnel of its own goroutine: a new gRPC
// connection, DIAL_REQ, B bytes sent and read back (checked), CLOSE_REQ and
// CLOSE_RSP. A tunnel not done within L fails. With -each, one line per
// tunnel as it ends:
//
//	{"start_us": µs since the epoch, "dial_us": until DIAL_RSP, "us": in all,
//	 "phase": "dial" or "exchange" (where it failed), "error": "..."}
//
// The last line sums up: "dials" (tunnels that went well), "dial_errors"
// (no connection: an error before or in DIAL_RSP), "exchange_errors" (the
// connection failed after its DIAL_RSP), "over_limit" (of those errors,
// the tunnels still not done at -limit: a request that would have waited
// for ever), "first_error", "seconds", and the
// dial latency (until DIAL_RSP) of the tunnels that went well: "p50_us",
// "p99_us", "max_us".

import (
	"encoding/json"
	"errors"
	"flag"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// rateOutcome is one tunnel's line.
type rateOutcome struct {
	StartUs int64  `json:"start_us"`
	DialUs  int64  `json:"dial_us"`
	Us      int64  `json:"us"`
	Phase   string `json:"phase,omitempty"`
	Error   string `json:"error,omitempty"`
}

// Where a tunnel is, for one that runs past its limit.
const (
	phaseDial     = 0
	phaseExchange = 1
)

// errOverLimit is a tunnel still not done at -limit.
var errOverLimit = errors.New("not done within -limit")

func rate(t *transport, argv []string) {
	args := flag.NewFlagSet("rate", flag.ExitOnError)
	addr := args.String("addr", "", "node-side HOST:PORT (an echo server)")
	perSecond := args.Float64("rate", 100, "tunnels started per second")
	duration := args.Duration("duration", 5*time.Second, "how long tunnels are started")
	exchange := args.Int("exchange", 1024, "bytes each way per tunnel")
	limit := args.Duration("limit", 30*time.Second, "longest a tunnel may take")
	each := args.Bool("each", false, "one line per tunnel")
	if err := args.Parse(argv); err != nil {
		fail("%v", err)
	}
	if *perSecond <= 0 {
		fail("-rate must be positive")
	}
	sent := pattern(*exchange, 3)
	interval := time.Duration(float64(time.Second) / *perSecond)

	var mu sync.Mutex
	out := json.NewEncoder(os.Stdout)
	var dialLatencies []int64
	var dialErrors, exchangeErrors, overLimit int
	var firstError string
	record := func(o rateOutcome) {
		mu.Lock()
		defer mu.Unlock()
		switch o.Phase {
		case "":
			dialLatencies = append(dialLatencies, o.DialUs)
		case "dial":
			dialErrors++
		default:
			exchangeErrors++
		}
		if o.Error == errOverLimit.Error() {
			overLimit++
		}
		if o.Error != "" && firstError == "" {
			firstError = o.Phase + ": " + o.Error
		}
		if *each {
			if err := out.Encode(o); err != nil {
				fail("writing a line: %v", err)
			}
		}
	}

	start := time.Now()
	var wg sync.WaitGroup
	for i := 0; ; i++ {
		at := start.Add(time.Duration(i) * interval)
		if at.Sub(start) >= *duration {
			break
		}
		time.Sleep(time.Until(at))
		wg.Add(1)
		go func() {
			defer wg.Done()
			began := time.Now()
			var dialed int64
			var phase int32
			done := make(chan error, 1)
			go func() {
				done <- singleUse(t, *addr, sent, make([]byte, len(sent)), func() {
					atomic.StoreInt64(&dialed, int64(time.Since(began)/time.Microsecond))
					atomic.StoreInt32(&phase, phaseExchange)
				})
			}()
			var err error
			select {
			case err = <-done:
			case <-time.After(*limit):
				err = errOverLimit
			}
			o := rateOutcome{
				StartUs: began.UnixNano() / 1000,
				DialUs:  atomic.LoadInt64(&dialed),
				Us:      int64(time.Since(began) / time.Microsecond),
			}
			if err != nil {
				o.Phase = "dial"
				if atomic.LoadInt32(&phase) == phaseExchange {
					o.Phase = "exchange"
				}
				o.Error = err.Error()
			}
			record(o)
		}()
	}
	wg.Wait()
	seconds := time.Since(start).Seconds()
	sort.Slice(dialLatencies, func(i, j int) bool { return dialLatencies[i] < dialLatencies[j] })
	quantile := func(q float64) int64 {
		if len(dialLatencies) == 0 {
			return 0
		}
		return dialLatencies[int(q*float64(len(dialLatencies)-1))]
	}
	report(map[string]interface{}{
		"dials": len(dialLatencies), "dial_errors": dialErrors, "exchange_errors": exchangeErrors,
		"over_limit":  overLimit,
		"first_error": firstError, "seconds": seconds,
		"p50_us": quantile(0.5), "p99_us": quantile(0.99), "max_us": quantile(1),
	})
}
