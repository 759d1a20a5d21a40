package main

// The soak mode (bench --scenarios soak): workers that exchange framed,
// checked requests with the bench's soak destination until stdin closes,
// printing their cumulative counts as one JSON line per second.
//
//	soak -addr A [-workers W -interval I] [-bulk B -rate R -bulk-bytes N] [-dial-limit D] [-stuck S]
//
// Each exchange is one tunnel (a new gRPC connection, or with -reuse a
// Proxy stream on the shared one): a 16-byte header (up length u32, down
// length u32, seed u64, big-endian), up bytes of the pattern stream of
// seed, then the destination's down bytes of the pattern stream of seed+1,
// then the end of the tunnel. Request/response workers start one exchange
// per interval, open loop (up to 16 in flight each); bulk workers move
// bulk-bytes up or down (alternately), paced at rate bytes/s.
//
// Each exchange ends as one of:
//   - ok: every byte arrived as sent, then a clean end;
//   - error: the tunnel told of an error (a failed dial, a stream error, a
//     DATA or CLOSE_RSP error);
//   - silent: bytes that differ, bytes missing before a clean end (CLOSE_RSP
//     without error, or the stream's end with status OK), or bytes past the
//     end: what the soak must never see;
//   - stuck: no end within -stuck (the tunnel is then cancelled).
//
// Besides the counts, each exchange is one JSON line when it ends, which
// the bench joins with the destination's record of the same exchange (by
// its seed): {"x": 1, "id": seed, "end": "ok"|"dial"|"error"|"silent"|
// "stuck", "start_ns": N, "end_ns": N, "dial_ns": N (-1 when the dial did
// not end), "why": "..."}, times in Unix nanoseconds.

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/ioutil"
	"math/rand"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// soakHeader is the length of an exchange's header.
const soakHeader = 16

// soakInFlight is the most request/response exchanges of one worker at once.
const soakInFlight = 16

// soakCounts are the cumulative counts a soak run reports.
type soakCounts struct {
	Started   int64 `json:"started"`
	Ok        int64 `json:"ok"`
	Errors    int64 `json:"errors"`
	Silent    int64 `json:"silent"`
	RrOk      int64 `json:"rr_ok"`
	BulkBytes int64 `json:"bulk_bytes"`
	Bytes     int64 `json:"bytes"`
	Late      int64 `json:"late_dials"`
	Skipped   int64 `json:"skipped"`
	DialMaxUs int64 `json:"dial_max_us"`
}

// soakStream is the byte stream of pattern(len, seed), produced a byte at
// a time (tests/src/destination.rs's pattern).
type soakStream struct{ x uint64 }

func newSoakStream(seed uint64) *soakStream {
	return &soakStream{x: seed*0x9E3779B97F4A7C15 | 1}
}

func (s *soakStream) fill(p []byte) {
	for i := range p {
		s.x ^= s.x << 13
		s.x ^= s.x >> 7
		s.x ^= s.x << 17
		p[i] = byte(s.x >> 24)
	}
}

// check reports whether p is the stream's next len(p) bytes.
func (s *soakStream) check(p []byte) bool {
	ok := true
	for _, b := range p {
		s.x ^= s.x << 13
		s.x ^= s.x >> 7
		s.x ^= s.x << 17
		if byte(s.x>>24) != b {
			ok = false
		}
	}
	return ok
}

// errSilent marks an exchange that lost or altered bytes without an error.
var errSilent = errors.New("bytes lost or altered without an error")

// pace sleeps so that moved bytes take at least moved/rate seconds since start.
func pace(start time.Time, moved int64, rate int) {
	if rate <= 0 {
		return
	}
	due := start.Add(time.Duration(float64(moved) / float64(rate) * float64(time.Second)))
	if wait := time.Until(due); wait > 0 {
		time.Sleep(wait)
	}
}

// errStuck marks an exchange that did not end within its bound.
var errStuck = errors.New("no end within the stuck bound")

// errDial wraps a failed dial.
type errDial struct{ err error }

func (e errDial) Error() string { return "dial: " + e.err.Error() }

// soakExchange runs one exchange and prints its line; nil, errSilent,
// errStuck, errDial, or the tunnel's error.
func soakExchange(t *transport, addr string, up, down int, rate int, counts *soakCounts, dialLimit, stuck time.Duration, bulk bool) error {
	seed := uint64(rand.Int63())
	began := time.Now()
	life, cancelLife := context.WithTimeout(context.Background(), stuck)
	defer cancelLife()
	dialNs := int64(-1)
	err := soakTunnel(t, addr, seed, up, down, rate, counts, dialLimit, bulk, life, &dialNs)
	if err != nil && !errors.Is(err, errSilent) && life.Err() == context.DeadlineExceeded {
		err = errStuck
	}
	end, why := "ok", ""
	var dialErr errDial
	switch {
	case err == nil:
	case errors.Is(err, errSilent):
		end, why = "silent", err.Error()
	case errors.Is(err, errStuck):
		end, why = "stuck", err.Error()
	case errors.As(err, &dialErr):
		end, why = "dial", dialErr.err.Error()
	default:
		end, why = "error", err.Error()
	}
	line, jerr := json.Marshal(soakRecord{
		X: 1, ID: seed, End: end, StartNs: began.UnixNano(),
		EndNs: time.Now().UnixNano(), DialNs: dialNs, Why: why,
	})
	if jerr != nil {
		fail("encoding an exchange's record: %v", jerr)
	}
	// Written as is: report() would pass the 64-bit id through a float.
	stdout.Lock()
	_, werr := os.Stdout.Write(append(line, '\n'))
	stdout.Unlock()
	if werr != nil {
		fail("writing an exchange's record: %v", werr)
	}
	return err
}

// soakRecord is one exchange's line.
type soakRecord struct {
	X       int    `json:"x"`
	ID      uint64 `json:"id"`
	End     string `json:"end"`
	StartNs int64  `json:"start_ns"`
	EndNs   int64  `json:"end_ns"`
	DialNs  int64  `json:"dial_ns"`
	Why     string `json:"why"`
}

// soakTunnel dials and runs one exchange within life.
func soakTunnel(t *transport, addr string, seed uint64, up, down int, rate int, counts *soakCounts, dialLimit time.Duration, bulk bool, life context.Context, dialNs *int64) error {
	moved := func(n int) {
		atomic.AddInt64(&counts.Bytes, int64(n))
		if bulk {
			atomic.AddInt64(&counts.BulkBytes, int64(n))
		}
	}
	ctx, cancel := context.WithTimeout(life, time.Minute)
	defer cancel()
	began := time.Now()
	// The dial's random is the exchange's seed: the server's audit record
	// of the dial names it, and the agent that answered.
	c, err := t.dialAs(ctx, life, addr, int64(seed))
	took := time.Since(began)
	for {
		old := atomic.LoadInt64(&counts.DialMaxUs)
		if took.Microseconds() <= old || atomic.CompareAndSwapInt64(&counts.DialMaxUs, old, took.Microseconds()) {
			break
		}
	}
	if took > dialLimit {
		atomic.AddInt64(&counts.Late, 1)
	}
	if err != nil {
		return errDial{err}
	}
	*dialNs = took.Nanoseconds()
	defer c.drop()
	var header [soakHeader]byte
	binary.BigEndian.PutUint32(header[0:], uint32(up))
	binary.BigEndian.PutUint32(header[4:], uint32(down))
	binary.BigEndian.PutUint64(header[8:], seed)
	if _, err := c.Write(header[:]); err != nil {
		return soakEnd(c, life, err)
	}
	out := newSoakStream(seed)
	buf := make([]byte, copyChunk)
	start := time.Now()
	for sent := 0; sent < up; {
		n := up - sent
		if n > len(buf) {
			n = len(buf)
		}
		out.fill(buf[:n])
		if _, err := c.Write(buf[:n]); err != nil {
			return soakEnd(c, life, err)
		}
		sent += n
		if bulk {
			moved(n)
		}
		pace(start, int64(sent), rate)
	}
	in := newSoakStream(seed + 1)
	start = time.Now()
	got := 0
	for got < down {
		n := down - got
		if n > len(buf) {
			n = len(buf)
		}
		k, err := c.Read(buf[:n])
		if k > 0 && !in.check(buf[:k]) {
			return errSilent
		}
		got += k
		if bulk {
			moved(k)
		}
		if err == io.EOF {
			return eofIn(life)
		}
		if err != nil {
			return err
		}
		pace(start, int64(got), rate)
	}
	// The destination closes once it has written: a clean end now.
	k, err := c.Read(buf[:1])
	if k > 0 {
		return errSilent
	}
	if err != io.EOF {
		return err
	}
	if !bulk {
		moved(up + got)
	}
	return nil
}

// eofIn is an EOF before the exchange's bytes all came: silent loss, or,
// once life is over, the end of a stream cancelled because the exchange
// was stuck (with -kclient, a connection whose close was dropped reads
// nothing until then).
func eofIn(life context.Context) error {
	if life.Err() == context.DeadlineExceeded {
		return errStuck
	}
	return errSilent
}

// soakEnd is the end of a tunnel whose write failed: the stream's own error,
// or errSilent when it ended cleanly with bytes unsent.
func soakEnd(c *conn, life context.Context, writeErr error) error {
	buf := make([]byte, copyChunk)
	for {
		_, err := c.Read(buf)
		if err == io.EOF {
			return eofIn(life)
		}
		if err != nil {
			return err
		}
	}
}

// soak runs the soak mode with its flags in argv.
func soak(t *transport, argv []string) {
	fs := flag.NewFlagSet("soak", flag.ExitOnError)
	addr := fs.String("addr", "", "the soak destination HOST:PORT")
	workers := fs.Int("workers", 4, "request/response workers")
	interval := fs.Duration("interval", 100*time.Millisecond, "one exchange per worker per interval")
	bulk := fs.Int("bulk", 1, "bulk workers")
	rate := fs.Int("rate", 4<<20, "bytes/s of each bulk worker")
	bulkBytes := fs.Int("bulk-bytes", 16<<20, "bytes of each bulk exchange")
	dialLimit := fs.Duration("dial-limit", 10*time.Second, "a dial slower than this is late")
	stuck := fs.Duration("stuck", 40*time.Second, "an exchange not ended within this is given up on (stuck)")
	if err := fs.Parse(argv); err != nil {
		fail("%v", err)
	}
	rand.Seed(time.Now().UnixNano())
	var counts soakCounts
	stop := make(chan struct{})
	var wg sync.WaitGroup
	record := func(err error) {
		switch {
		case err == nil:
			atomic.AddInt64(&counts.Ok, 1)
		case errors.Is(err, errSilent):
			atomic.AddInt64(&counts.Silent, 1)
			fmtErr("lost silently: %v", err)
		default:
			atomic.AddInt64(&counts.Errors, 1)
		}
	}
	stopped := func() bool {
		select {
		case <-stop:
			return true
		default:
			return false
		}
	}
	// Open loop: each tick starts an exchange whatever the earlier ones are
	// doing (up to soakInFlight at once per worker), so that exchanges stuck
	// on a faulty agent do not hold back the load on healthy ones.
	for w := 0; w < *workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			slots := make(chan struct{}, soakInFlight)
			var inFlight sync.WaitGroup
			defer inFlight.Wait()
			tick := time.NewTicker(*interval)
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				select {
				case slots <- struct{}{}:
				default:
					atomic.AddInt64(&counts.Skipped, 1)
					continue
				}
				atomic.AddInt64(&counts.Started, 1)
				inFlight.Add(1)
				go func() {
					defer inFlight.Done()
					defer func() { <-slots }()
					err := soakExchange(t, *addr, 1024+rand.Intn(15*1024), 1024+rand.Intn(63*1024), 0, &counts, *dialLimit, *stuck, false)
					if err == nil {
						atomic.AddInt64(&counts.RrOk, 1)
					}
					record(err)
				}()
			}
		}()
	}
	for w := 0; w < *bulk; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; !stopped(); i++ {
				up, down := *bulkBytes, 1024
				if i%2 == 1 {
					up, down = 1024, *bulkBytes
				}
				atomic.AddInt64(&counts.Started, 1)
				err := soakExchange(t, *addr, up, down, *rate, &counts, *dialLimit, *stuck, true)
				record(err)
				if err != nil {
					time.Sleep(*interval)
				}
			}
		}(w)
	}
	go func() {
		io.Copy(ioutil.Discard, os.Stdin)
		close(stop)
	}()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	snapshot := func() map[string]int64 {
		return map[string]int64{
			"started": atomic.LoadInt64(&counts.Started), "ok": atomic.LoadInt64(&counts.Ok),
			"errors": atomic.LoadInt64(&counts.Errors), "silent": atomic.LoadInt64(&counts.Silent),
			"rr_ok": atomic.LoadInt64(&counts.RrOk), "bulk_bytes": atomic.LoadInt64(&counts.BulkBytes),
			"bytes": atomic.LoadInt64(&counts.Bytes), "late_dials": atomic.LoadInt64(&counts.Late),
			"dial_max_us": atomic.LoadInt64(&counts.DialMaxUs),
			"skipped":     atomic.LoadInt64(&counts.Skipped),
		}
	}
	for {
		select {
		case <-done:
			final := snapshot()
			final["final"] = 1
			report(final)
			return
		case <-tick.C:
			report(snapshot())
		}
	}
}

// fmtErr writes one line to stderr.
func fmtErr(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "frontend: "+format+"\n", args...)
}
