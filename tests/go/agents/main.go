// Command agents is a swarm of konnectivity agents on grpc-go, the way
// ANP's proxy-agent connects: each agent dials its own gRPC connection
// (grpc.Dial with TLS: a client certificate, or a service-account token in
// the request metadata), with no TLS session cache (every handshake is a
// full one, as ANP's agents make), and opens one AgentService/Connect
// stream with ANP's agent metadata (agentID, agentIdentifiers). It then
// holds the stream open, answering each DIAL_REQ with a DIAL_RSP that
// refuses it, until the stream ends. After a failure or a dropped stream
// it closes the connection and tries again 1 to 2 s later (uniformly
// jittered), as ANP's agent retries every --sync-interval.
//
// Built from Debian's grpc-go in GOPATH mode (no module download):
//
//	GOPATH=/usr/share/gocode GO111MODULE=off go build -o agents ./tests/go/agents
//
// Usage:
//
//	agents -addr HOST:PORT -ca F (-cert F -key F | -token-dir D) -count N [-first K]
//	       [-server-name localhost] [-retry-min 1s] [-retry-max 2s] [-report 200ms]
//	       [-latency D]
//
// Agent k (from -first to -first+count-1) has the id "swarm-k"; with
// -token-dir, its token is the file D/token-k. With -latency, each agent's
// connection holds what it sends, and what it receives, for half of D
// each: a round trip D longer, as netem would make it, for a kernel
// without netem (the TCP handshake itself is not delayed).
//
// Every -report, and once more when it ends, it prints one JSON line on
// stdout:
//
//	{"agents":N,"connected":C,"attempts":A,"failures":F,"drops":D,"dials":R}
//
// connected: agents whose Connect stream is up now (the server's headers
// came); attempts: connections tried so far; failures: attempts that never
// got a stream up (dial, TLS, refused stream, no headers); drops: streams
// that were up and ended; dials: DIAL_REQs refused. It ends when its stdin
// closes.
//
// The messages are encoded with protowire (the wire format of
// client.proto, written down here) through a codec registered as "proto",
// grpc-go's default, so the headers on the wire are exactly those of
// generated code.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/ioutil"
	"math/rand"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protowire"
)

// Packet types of client.proto.
const (
	dialReq = 0
	dialRsp = 1
)

// packet is the part of client.proto's Packet an agent that refuses
// every dial needs: the type, and a dial's random id (DialRequest and
// DialResponse field 3), and a DialResponse's error.
type packet struct {
	typ     int64
	random  int64
	errText string
}

// payloadField is the oneof field number of each packet type's payload.
var payloadField = map[int64]protowire.Number{dialReq: 2, dialRsp: 3}

func (p *packet) marshal() []byte {
	var inner []byte
	if p.errText != "" {
		inner = protowire.AppendTag(inner, 1, protowire.BytesType)
		inner = protowire.AppendString(inner, p.errText)
	}
	if p.random != 0 {
		inner = protowire.AppendTag(inner, 3, protowire.VarintType)
		inner = protowire.AppendVarint(inner, uint64(p.random))
	}
	var b []byte
	if p.typ != 0 {
		b = protowire.AppendTag(b, 1, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(p.typ))
	}
	b = protowire.AppendTag(b, payloadField[p.typ], protowire.BytesType)
	return protowire.AppendBytes(b, inner)
}

// fields calls f for each field of the message in b; f returns the length
// of the field's value it consumed, or a negative error code.
func fields(b []byte, f func(n protowire.Number, t protowire.Type, b []byte) int) error {
	for len(b) > 0 {
		n, t, k := protowire.ConsumeTag(b)
		if k < 0 {
			return protowire.ParseError(k)
		}
		b = b[k:]
		k = f(n, t, b)
		if k < 0 {
			return protowire.ParseError(k)
		}
		b = b[k:]
	}
	return nil
}

func (p *packet) unmarshal(b []byte) error {
	*p = packet{}
	var request []byte
	err := fields(b, func(n protowire.Number, t protowire.Type, b []byte) int {
		switch {
		case n == 1 && t == protowire.VarintType:
			v, k := protowire.ConsumeVarint(b)
			p.typ = int64(v)
			return k
		case n == 2 && t == protowire.BytesType:
			v, k := protowire.ConsumeBytes(b)
			request = v
			return k
		}
		return protowire.ConsumeFieldValue(n, t, b)
	})
	if err != nil || p.typ != dialReq {
		return err
	}
	return fields(request, func(n protowire.Number, t protowire.Type, b []byte) int {
		if n == 3 && t == protowire.VarintType {
			v, k := protowire.ConsumeVarint(b)
			p.random = int64(v)
			return k
		}
		return protowire.ConsumeFieldValue(n, t, b)
	})
}

// codec carries *packet values; registered as "proto", grpc-go's default.
type codec struct{}

func (codec) Marshal(v interface{}) ([]byte, error)   { return v.(*packet).marshal(), nil }
func (codec) Unmarshal(b []byte, v interface{}) error { return v.(*packet).unmarshal(b) }
func (codec) Name() string                            { return "proto" }

func init() { encoding.RegisterCodec(codec{}) }

var connectStream = &grpc.StreamDesc{StreamName: "Connect", ServerStreams: true, ClientStreams: true}

// counts is what the swarm reports.
type counts struct {
	connected int64
	attempts  int64
	failures  int64
	drops     int64
	dials     int64
}

// swarm is the settings every agent shares.
type swarm struct {
	addr      string
	tls       *tls.Config
	tokenDir  string
	retryMin  time.Duration
	retrySpan time.Duration
	// oneWay is the delay added to each direction (-latency / 2).
	oneWay time.Duration
	counts counts
}

// agent runs agent k until ctx ends: connect, hold the stream, retry.
func (s *swarm) agent(ctx context.Context, k int) {
	rng := rand.New(rand.NewSource(time.Now().UnixNano() + int64(k)))
	for ctx.Err() == nil {
		atomic.AddInt64(&s.counts.attempts, 1)
		if err := s.connect(ctx, k); err != nil {
			atomic.AddInt64(&s.counts.failures, 1)
		}
		wait := s.retryMin
		if s.retrySpan > 0 {
			wait += time.Duration(rng.Int63n(int64(s.retrySpan)))
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

// connect makes one connection of agent k and holds its stream until it
// ends; an error if the stream never came up.
func (s *swarm) connect(ctx context.Context, k int) error {
	// Each agent its own configuration: nothing shared between their
	// connections, and no session cache (ClientSessionCache is nil).
	opts := []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(s.tls.Clone()))}
	if s.oneWay > 0 {
		opts = append(opts, grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			var d net.Dialer
			conn, err := d.DialContext(ctx, "tcp", addr)
			if err != nil {
				return nil, err
			}
			return newLateConn(conn, s.oneWay), nil
		}))
	}
	cc, err := grpc.Dial(s.addr, opts...)
	if err != nil {
		return err
	}
	defer cc.Close()
	streamCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	md := []string{"agentID", fmt.Sprintf("swarm-%d", k), "agentIdentifiers", ""}
	if s.tokenDir != "" {
		token, err := ioutil.ReadFile(filepath.Join(s.tokenDir, fmt.Sprintf("token-%d", k)))
		if err != nil {
			return err
		}
		md = append(md, "authorization", "Bearer "+strings.TrimSpace(string(token)))
	}
	streamCtx = metadata.AppendToOutgoingContext(streamCtx, md...)
	stream, err := cc.NewStream(streamCtx, connectStream, "/AgentService/Connect")
	if err != nil {
		return err
	}
	header, err := stream.Header()
	if err != nil {
		return err
	}
	if len(header.Get("serverID")) != 1 || len(header.Get("serverCount")) != 1 {
		return fmt.Errorf("no serverID or serverCount in the headers: %v", header)
	}
	atomic.AddInt64(&s.counts.connected, 1)
	defer atomic.AddInt64(&s.counts.connected, -1)
	defer atomic.AddInt64(&s.counts.drops, 1)
	for {
		var p packet
		if err := stream.RecvMsg(&p); err != nil {
			return nil
		}
		if p.typ == dialReq {
			atomic.AddInt64(&s.counts.dials, 1)
			rsp := &packet{typ: dialRsp, random: p.random, errText: "the agent swarm dials nothing"}
			if err := stream.SendMsg(rsp); err != nil {
				return nil
			}
		}
	}
}

// chunk is bytes that may pass at a time.
type chunk struct {
	at   time.Time
	data []byte
	err  error
}

// lateConn delays both directions of a connection by delay: what is
// written leaves delay later, what arrives is read delay later, in order.
// Its two goroutines end when it is closed.
type lateConn struct {
	net.Conn
	delay   time.Duration
	in      chan chunk
	out     chan chunk
	pending []byte
	err     error
	closed  chan struct{}
	once    sync.Once
}

func newLateConn(conn net.Conn, delay time.Duration) *lateConn {
	c := &lateConn{
		Conn:   conn,
		delay:  delay,
		in:     make(chan chunk, 64),
		out:    make(chan chunk, 64),
		closed: make(chan struct{}),
	}
	go c.receive()
	go c.send()
	return c
}

// wait sleeps until at, or until the connection is closed.
func (c *lateConn) wait(at time.Time) bool {
	t := time.NewTimer(time.Until(at))
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-c.closed:
		return false
	}
}

// receive reads the connection, stamping each chunk with when it may be
// read.
func (c *lateConn) receive() {
	for {
		buf := make([]byte, 8192)
		n, err := c.Conn.Read(buf)
		select {
		case c.in <- chunk{at: time.Now().Add(c.delay), data: buf[:n], err: err}:
		case <-c.closed:
			return
		}
		if err != nil {
			return
		}
	}
}

// send writes each chunk when its time comes.
func (c *lateConn) send() {
	for {
		select {
		case ch := <-c.out:
			if !c.wait(ch.at) {
				return
			}
			if _, err := c.Conn.Write(ch.data); err != nil {
				c.Conn.Close()
				return
			}
		case <-c.closed:
			return
		}
	}
}

func (c *lateConn) Read(p []byte) (int, error) {
	for len(c.pending) == 0 {
		if c.err != nil {
			return 0, c.err
		}
		var ch chunk
		select {
		case ch = <-c.in:
		case <-c.closed:
			return 0, net.ErrClosed
		}
		if !c.wait(ch.at) {
			return 0, net.ErrClosed
		}
		c.pending, c.err = ch.data, ch.err
	}
	n := copy(p, c.pending)
	c.pending = c.pending[n:]
	return n, nil
}

func (c *lateConn) Write(p []byte) (int, error) {
	data := append([]byte(nil), p...)
	select {
	case c.out <- chunk{at: time.Now().Add(c.delay), data: data}:
		return len(p), nil
	case <-c.closed:
		return 0, net.ErrClosed
	}
}

func (c *lateConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// report prints the counts as one JSON line.
func (s *swarm) report(agents int) {
	line, _ := json.Marshal(map[string]int64{
		"agents":    int64(agents),
		"connected": atomic.LoadInt64(&s.counts.connected),
		"attempts":  atomic.LoadInt64(&s.counts.attempts),
		"failures":  atomic.LoadInt64(&s.counts.failures),
		"drops":     atomic.LoadInt64(&s.counts.drops),
		"dials":     atomic.LoadInt64(&s.counts.dials),
	})
	fmt.Println(string(line))
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "agents: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	addr := flag.String("addr", "", "proxy-server's agent HOST:PORT")
	ca := flag.String("ca", "", "CA of the server certificate")
	cert := flag.String("cert", "", "client certificate (mTLS)")
	key := flag.String("key", "", "client key (mTLS)")
	tokenDir := flag.String("token-dir", "", "directory of token-K files (token auth)")
	serverName := flag.String("server-name", "localhost", "name the server certificate must carry")
	count := flag.Int("count", 1, "agents")
	first := flag.Int("first", 0, "index of the first agent")
	retryMin := flag.Duration("retry-min", time.Second, "least wait before a retry")
	retryMax := flag.Duration("retry-max", 2*time.Second, "longest wait before a retry")
	every := flag.Duration("report", 200*time.Millisecond, "how often to print the counts")
	latency := flag.Duration("latency", 0, "round trip to add, half each way (for a kernel without netem)")
	flag.Parse()
	if *addr == "" || *ca == "" {
		fail("-addr and -ca are required")
	}
	if (*cert == "") != (*key == "") || (*cert == "" && *tokenDir == "") {
		fail("give -cert and -key, or -token-dir")
	}
	if *retryMax < *retryMin {
		fail("-retry-max %v is below -retry-min %v", *retryMax, *retryMin)
	}
	pem, err := ioutil.ReadFile(*ca)
	if err != nil {
		fail("reading -ca %s: %v", *ca, err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		fail("no certificate in -ca %s", *ca)
	}
	config := &tls.Config{RootCAs: roots, ServerName: *serverName}
	if *cert != "" {
		pair, err := tls.LoadX509KeyPair(*cert, *key)
		if err != nil {
			fail("loading -cert %s / -key %s: %v", *cert, *key, err)
		}
		config.Certificates = []tls.Certificate{pair}
	}
	s := &swarm{
		addr:      *addr,
		tls:       config,
		tokenDir:  *tokenDir,
		retryMin:  *retryMin,
		retrySpan: *retryMax - *retryMin,
		oneWay:    *latency / 2,
	}
	ctx, cancel := context.WithCancel(context.Background())
	// Ends when stdin closes (the bench that started it is gone or done).
	go func() {
		io.Copy(ioutil.Discard, os.Stdin)
		cancel()
	}()
	for k := *first; k < *first+*count; k++ {
		go s.agent(ctx, k)
	}
	ticker := time.NewTicker(*every)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			s.report(*count)
			return
		case <-ticker.C:
			s.report(*count)
		}
	}
}
