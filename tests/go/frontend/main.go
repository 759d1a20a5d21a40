// Command frontend is a konnectivity frontend on grpc-go, kube-apiserver's
// gRPC client: it speaks ProxyService/Proxy the way kube-apiserver's egress
// dialer does. Each tunnel is a new gRPC connection (grpc.Dial with the
// socket path as the target and a context dialer to the Unix socket, so
// grpc-go picks its own :authority; or TCP with mTLS), DIAL_REQ with a
// random id, DATA both ways, CLOSE_REQ. With -reuse, every tunnel is a
// Proxy stream on one gRPC connection, as konnectivity-client's
// CreateGRPCTunnel (the reusable tunnel) does. No HTTP/2 or window settings
// of its own: grpc-go's defaults (16 KiB frames, 64 KiB initial windows
// grown by BDP pings).
//
// Built from Debian's grpc-go in GOPATH mode (no module download):
//
//	GOPATH=/usr/share/gocode GO111MODULE=off go build -o frontend ./tests/go/frontend
//
// Usage: frontend (-uds PATH | -tcp HOST:PORT -ca F -cert F -key F) [-reuse] [-kclient] MODE -addr HOST:PORT ...
//
// With -kclient, each stream's packets are handled as konnectivity-client
// handles them (a receiving goroutine, connections registered by the
// dialing goroutine after their DIAL_RSP: kclient.go); without, each
// tunnel reads its own stream in line.
//
// Modes (each prints one JSON line on stdout and exits 0 when it did what
// was asked, else prints the error on stderr and exits 1):
//
//	download -bytes N [-seed S]   read N bytes; with -seed, check them against pattern(N, S)
//	upload -bytes N [-hash]       send N bytes of pattern(N, 11); with -hash, send the length
//	                              first and read the destination's FNV-1a answer
//	download -bytes 0, upload -bytes 0
//	                              move bytes without end, printing {"bytes": N} (so far)
//	                              every 100 ms, until stdin closes (the bench)
//	echo -bytes N                 send N bytes and read them back, checked
//	dials -concurrency C (-count N | -duration D) [-exchange B] [-limit L]
//	                              single-use tunnels, each sending B bytes and reading B back;
//	                              with -limit, a tunnel not done within L is "over_limit"
//	dial-error                    expect the dial to fail; print the error
//	stall                         open a tunnel and read nothing until stdin closes
//	stall-bulk -stall A -bytes N -seed S
//	                              open a tunnel to A and read nothing; beside it, read
//	                              N bytes from -addr, checked against pattern(N, S)
//	many -count N [-stall A]      hold N tunnels to -addr (an echo server) open at
//	                              once, each echoing 1 KiB when opened; with -stall,
//	                              one more to A that is never read. Prints {"open": N}
//	                              and, once stdin closes, echoes 1 KiB on each again
//	                              and closes them all (exit 0: all did)
//	soak -addr A ...              the bench's soak traffic until stdin closes (soak.go)
//	rate -addr A -rate R -duration D [-each]
//	                              single-use tunnels started at a steady rate, each
//	                              outcome and latency a line with -each (rate.go)
//	cut -count N                  open N tunnels to -addr (an echo server), echo on
//	                              each, close the gRPC connection under them, and
//	                              check that every stream fails
//
// Every report has "connections": the gRPC connections dialed.
//
// The messages are encoded with protowire (the wire format of client.proto,
// written down here) through a codec registered as "proto", grpc-go's
// default, so the headers on the wire are exactly those of generated code.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/ioutil"
	"math/rand"
	"net"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding"
	"google.golang.org/protobuf/encoding/protowire"
)

// Packet types of client.proto.
const (
	dialReq  = 0
	dialRsp  = 1
	closeReq = 2
	closeRsp = 3
	data     = 4
	dialCls  = 5
)

// packet is client.proto's Packet, flattened: the fields of whichever
// payload its type carries.
type packet struct {
	typ      int64
	protocol string // DialRequest
	address  string // DialRequest
	random   int64  // DialRequest, DialResponse, CloseDial
	errText  string // DialResponse, CloseResponse, Data
	connID   int64  // DialResponse, CloseRequest, CloseResponse, Data
	data     []byte // Data
}

// payloadField is the oneof field number of each packet type's payload.
var payloadField = map[int64]protowire.Number{
	dialReq: 2, dialRsp: 3, data: 4, closeReq: 5, closeRsp: 6, dialCls: 7,
}

func appendString(b []byte, n protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	return protowire.AppendString(protowire.AppendTag(b, n, protowire.BytesType), s)
}

func appendInt(b []byte, n protowire.Number, v int64) []byte {
	if v == 0 {
		return b
	}
	return protowire.AppendVarint(protowire.AppendTag(b, n, protowire.VarintType), uint64(v))
}

func (p *packet) marshal() []byte {
	var inner []byte
	switch p.typ {
	case dialReq:
		inner = appendString(inner, 1, p.protocol)
		inner = appendString(inner, 2, p.address)
		inner = appendInt(inner, 3, p.random)
	case closeReq:
		inner = appendInt(inner, 1, p.connID)
	case data:
		inner = appendInt(inner, 1, p.connID)
		inner = appendString(inner, 2, p.errText)
		if len(p.data) > 0 {
			inner = protowire.AppendBytes(protowire.AppendTag(inner, 3, protowire.BytesType), p.data)
		}
	case dialCls:
		inner = appendInt(inner, 1, p.random)
	}
	b := make([]byte, 0, len(inner)+16)
	b = appendInt(b, 1, p.typ)
	b = protowire.AppendTag(b, payloadField[p.typ], protowire.BytesType)
	return protowire.AppendBytes(b, inner)
}

// fields calls f for each field of the message in b.
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

// value reads a varint or a length-delimited field into v or s.
func value(t protowire.Type, b []byte, v *int64, s *[]byte) int {
	switch t {
	case protowire.VarintType:
		x, k := protowire.ConsumeVarint(b)
		if v != nil {
			*v = int64(x)
		}
		return k
	case protowire.BytesType:
		x, k := protowire.ConsumeBytes(b)
		if s != nil {
			*s = x
		}
		return k
	}
	return protowire.ConsumeFieldValue(0, t, b)
}

func (p *packet) unmarshal(b []byte) error {
	*p = packet{}
	var payload []byte
	err := fields(b, func(n protowire.Number, t protowire.Type, b []byte) int {
		switch {
		case n == 1:
			return value(t, b, &p.typ, nil)
		case n >= 2 && n <= 8:
			return value(t, b, nil, &payload)
		}
		return protowire.ConsumeFieldValue(n, t, b)
	})
	if err != nil {
		return err
	}
	return fields(payload, func(n protowire.Number, t protowire.Type, b []byte) int {
		var s []byte
		var k int
		switch p.typ {
		case dialRsp:
			switch n {
			case 1:
				k = value(t, b, nil, &s)
				p.errText = string(s)
				return k
			case 2:
				return value(t, b, &p.connID, nil)
			case 3:
				return value(t, b, &p.random, nil)
			}
		case closeRsp:
			switch n {
			case 1:
				k = value(t, b, nil, &s)
				p.errText = string(s)
				return k
			case 2:
				return value(t, b, &p.connID, nil)
			}
		case data:
			switch n {
			case 1:
				return value(t, b, &p.connID, nil)
			case 2:
				k = value(t, b, nil, &s)
				p.errText = string(s)
				return k
			case 3:
				return value(t, b, nil, &p.data)
			}
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

var proxyStream = &grpc.StreamDesc{StreamName: "Proxy", ServerStreams: true, ClientStreams: true}

// transport says how to reach proxy-server's frontend.
type transport struct {
	uds  string
	tcp  string
	cred credentials.TransportCredentials
	// reuse: one gRPC connection for every tunnel (shared, made once).
	reuse bool
	// kclient: packets handled as konnectivity-client does (kclient.go).
	kclient bool
	once    sync.Once
	shared  *grpc.ClientConn
	err     error
	// dialed counts the gRPC connections dialed.
	dialed int64
}

// conn is one tunneled connection: a Proxy stream, on a gRPC connection of
// its own or on the shared one.
type conn struct {
	cc     *grpc.ClientConn
	own    bool
	cancel context.CancelFunc
	stream grpc.ClientStream
	id     int64
	// pending holds bytes of a DATA packet not yet read.
	pending []byte
	eof     bool
	// With -kclient: the stream's receiving goroutine and the
	// connection's registration in it.
	ks *kcStream
	kc *kcConn
}

// errEOF is io.EOF (kclient.go reads without importing io).
var errEOF = io.EOF

// connect dials a gRPC connection as kube-apiserver does.
func (t *transport) connect(ctx context.Context) (*grpc.ClientConn, error) {
	dialer := func(ctx context.Context, target string) (net.Conn, error) {
		atomic.AddInt64(&t.dialed, 1)
		var d net.Dialer
		if t.uds != "" {
			return d.DialContext(ctx, "unix", t.uds)
		}
		return d.DialContext(ctx, "tcp", target)
	}
	if t.uds != "" {
		return grpc.DialContext(ctx, t.uds, grpc.WithInsecure(), grpc.WithContextDialer(dialer))
	}
	return grpc.DialContext(ctx, t.tcp, grpc.WithTransportCredentials(t.cred), grpc.WithContextDialer(dialer))
}

// dial opens a Proxy stream (on a new gRPC connection, or with -reuse on
// the shared one) and dials address through it.
func (t *transport) dial(ctx context.Context, address string) (*conn, error) {
	return t.dialIn(ctx, context.Background(), address)
}

// dialIn is dial with the stream's life bound to life: once life is done,
// the stream is cancelled (the soak's stuck exchanges).
func (t *transport) dialIn(ctx, life context.Context, address string) (*conn, error) {
	return t.dialAs(ctx, life, address, rand.Int63())
}

// dialAs is dialIn with the DIAL_REQ's random given: the soak's exchange
// id, which the server's audit record of the dial carries (dial_id).
func (t *transport) dialAs(ctx, life context.Context, address string, random int64) (*conn, error) {
	c := &conn{own: !t.reuse}
	if t.reuse {
		t.once.Do(func() { t.shared, t.err = t.connect(context.Background()) })
		if t.err != nil {
			return nil, t.err
		}
		c.cc = t.shared
	} else {
		cc, err := t.connect(ctx)
		if err != nil {
			return nil, err
		}
		c.cc = cc
	}
	streamCtx, cancel := context.WithCancel(life)
	c.cancel = cancel
	stream, err := c.cc.NewStream(streamCtx, proxyStream, "/ProxyService/Proxy")
	if err != nil {
		c.drop()
		return nil, err
	}
	c.stream = stream
	if t.kclient {
		c.ks = kcStart(c)
		if err := c.ks.dial(ctx, c, address, random); err != nil {
			c.drop()
			return nil, err
		}
		return c, nil
	}
	if err := stream.SendMsg(&packet{typ: dialReq, protocol: "tcp", address: address, random: random}); err != nil {
		c.drop()
		return nil, err
	}
	var rsp packet
	if err := stream.RecvMsg(&rsp); err != nil {
		c.drop()
		return nil, err
	}
	if rsp.typ != dialRsp || rsp.random != random {
		c.drop()
		return nil, fmt.Errorf("expected DIAL_RSP for %d, got type %d for %d", random, rsp.typ, rsp.random)
	}
	if rsp.errText != "" {
		c.drop()
		return nil, dialError(rsp.errText)
	}
	c.id = rsp.connID
	return c, nil
}

// drop ends the tunnel without CLOSE_REQ: its stream is cancelled, and its
// gRPC connection closed if it has one of its own.
func (c *conn) drop() {
	c.cancel()
	if c.own {
		c.cc.Close()
	}
}

// dialError is the agent's dial error, from DIAL_RSP.
type dialError string

func (e dialError) Error() string { return string(e) }

// Write sends p as one DATA packet, as kube-apiserver's client does with
// each Write.
func (c *conn) Write(p []byte) (int, error) {
	if err := c.stream.SendMsg(&packet{typ: data, connID: c.id, data: p}); err != nil {
		return 0, err
	}
	return len(p), nil
}

// copyChunk is io.Copy's buffer: what a proxied stream hands each Write.
const copyChunk = 32 * 1024

// writeAll writes p in copyChunk pieces.
func (c *conn) writeAll(p []byte) error {
	for off := 0; off < len(p); off += copyChunk {
		end := off + copyChunk
		if end > len(p) {
			end = len(p)
		}
		if _, err := c.Write(p[off:end]); err != nil {
			return err
		}
	}
	return nil
}

// Read returns the bytes of DATA packets; io.EOF after CLOSE_RSP.
func (c *conn) Read(p []byte) (int, error) {
	if c.kc != nil {
		return c.kc.read(c, p)
	}
	for len(c.pending) == 0 {
		if c.eof {
			return 0, io.EOF
		}
		var pkt packet
		if err := c.stream.RecvMsg(&pkt); err != nil {
			return 0, err
		}
		switch pkt.typ {
		case data:
			if pkt.errText != "" {
				return 0, errors.New(pkt.errText)
			}
			c.pending = pkt.data
		case closeRsp:
			c.eof = true
			if pkt.errText != "" {
				return 0, fmt.Errorf("CLOSE_RSP: %s", pkt.errText)
			}
		default:
			return 0, fmt.Errorf("unexpected packet type %d", pkt.typ)
		}
	}
	n := copy(p, c.pending)
	c.pending = c.pending[n:]
	return n, nil
}

// Close sends CLOSE_REQ, waits for CLOSE_RSP (discarding DATA) and ends
// the stream (and its gRPC connection, when it has one of its own).
func (c *conn) Close() error {
	defer c.drop()
	if c.kc != nil {
		return c.kc.close(c, c.ks)
	}
	if c.eof {
		return nil
	}
	if err := c.stream.SendMsg(&packet{typ: closeReq, connID: c.id}); err != nil {
		return err
	}
	for {
		var pkt packet
		if err := c.stream.RecvMsg(&pkt); err != nil {
			return err
		}
		if pkt.typ == closeRsp {
			if pkt.errText != "" {
				return fmt.Errorf("CLOSE_RSP: %s", pkt.errText)
			}
			return nil
		}
	}
}

// pattern is tests/src/destination.rs's pattern(len, seed).
func pattern(n int, seed uint64) []byte {
	x := seed*0x9E3779B97F4A7C15 | 1
	out := make([]byte, n)
	for i := range out {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		out[i] = byte(x >> 24)
	}
	return out
}

// fnv is FNV-1a, 64 bit (tests/src/destination.rs's Fnv).
func fnv(b []byte) uint64 {
	h := uint64(0xcbf29ce484222325)
	for _, c := range b {
		h ^= uint64(c)
		h *= 0x100000001b3
	}
	return h
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "frontend: "+format+"\n", args...)
	os.Exit(1)
}

// the transport of this run, for the reports.
var current *transport

// stdout serializes the lines written to stdout (the soak writes from
// many goroutines).
var stdout sync.Mutex

// report prints v, a map, as one JSON line, with "connections": the gRPC
// connections dialed so far.
func report(v interface{}) {
	stdout.Lock()
	defer stdout.Unlock()
	b, err := json.Marshal(v)
	if err != nil {
		fail("encoding the result: %v", err)
	}
	fields := map[string]interface{}{}
	if err := json.Unmarshal(b, &fields); err != nil {
		fail("decoding the result: %v", err)
	}
	if current != nil {
		fields["connections"] = atomic.LoadInt64(&current.dialed)
	}
	if err := json.NewEncoder(os.Stdout).Encode(fields); err != nil {
		fail("writing the result: %v", err)
	}
}

func main() {
	uds := flag.String("uds", "", "proxy-server's frontend Unix socket (its --uds-name)")
	tcp := flag.String("tcp", "", "proxy-server's frontend HOST:PORT (TCP with mTLS)")
	ca := flag.String("ca", "", "CA of the server certificate (TCP)")
	cert := flag.String("cert", "", "client certificate (TCP)")
	key := flag.String("key", "", "client key (TCP)")
	serverName := flag.String("server-name", "localhost", "name the server certificate must carry (TCP)")
	reuse := flag.Bool("reuse", false, "one gRPC connection for every tunnel (the reusable tunnel)")
	kclient := flag.Bool("kclient", false, "handle packets as konnectivity-client does (kclient.go)")
	flag.Parse()
	if flag.NArg() < 1 {
		fail("no mode (download, upload, echo, dials, dial-error, stall)")
	}
	t := &transport{uds: *uds, tcp: *tcp, reuse: *reuse, kclient: *kclient}
	current = t
	if *tcp != "" {
		pair, err := tls.LoadX509KeyPair(*cert, *key)
		if err != nil {
			fail("loading -cert %s / -key %s: %v", *cert, *key, err)
		}
		pem, err := ioutil.ReadFile(*ca)
		if err != nil {
			fail("reading -ca %s: %v", *ca, err)
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			fail("-ca %s holds no certificate", *ca)
		}
		t.cred = credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{pair}, RootCAs: roots, ServerName: *serverName})
	} else if *uds == "" {
		fail("give -uds or -tcp")
	}
	mode := flag.Arg(0)
	switch mode {
	case "soak":
		soak(t, flag.Args()[1:])
		return
	case "rate":
		rate(t, flag.Args()[1:])
		return
	}
	args := flag.NewFlagSet(mode, flag.ExitOnError)
	addr := args.String("addr", "", "node-side HOST:PORT to dial")
	size := args.Int("bytes", 0, "bytes to move")
	seed := args.Int64("seed", -1, "download: check the bytes against pattern(bytes, seed)")
	hash := args.Bool("hash", false, "upload: length first, then read the FNV-1a answer")
	concurrency := args.Int("concurrency", 8, "dials: tunnels at once")
	count := args.Int("count", 0, "dials: tunnels in all (0: for -duration)")
	duration := args.Duration("duration", 0, "dials: how long")
	exchange := args.Int("exchange", 1024, "dials: bytes each way per tunnel")
	limit := args.Duration("limit", 0, "dials: a tunnel not done within this is over_limit (0: no bound)")
	stall := args.String("stall", "", "stall-bulk, many: HOST:PORT of a tunnel never read")
	if err := args.Parse(flag.Args()[1:]); err != nil {
		fail("%v", err)
	}
	rand.Seed(time.Now().UnixNano())
	ctx := context.Background()
	switch mode {
	case "download":
		download(ctx, t, *addr, *size, *seed)
	case "upload":
		upload(ctx, t, *addr, *size, *hash)
	case "echo":
		echo(ctx, t, *addr, *size)
	case "dials":
		dials(t, *addr, *concurrency, *count, *duration, *exchange, *limit)
	case "dial-error":
		c, err := t.dial(ctx, *addr)
		if err == nil {
			c.Close()
			fail("the dial to %s succeeded", *addr)
		}
		var de dialError
		if !errors.As(err, &de) {
			fail("expected a DIAL_RSP error, got %v", err)
		}
		report(map[string]string{"error": string(de)})
	case "stall":
		c, err := t.dial(ctx, *addr)
		if err != nil {
			fail("dial %s: %v", *addr, err)
		}
		report(map[string]string{"stalled": *addr})
		io.Copy(ioutil.Discard, os.Stdin)
		c.drop()
	case "stall-bulk":
		stallBulk(ctx, t, *stall, *addr, *size, *seed)
	case "many":
		many(ctx, t, *addr, *stall, *count)
	case "cut":
		cut(ctx, t, *addr, *count)
	default:
		fail("unknown mode %q", mode)
	}
}

// endless moves bytes with move (a read or a write of up to 32 KiB) until
// it fails or stdin closes, printing the bytes moved so far every 100 ms.
func endless(c *conn, move func([]byte) (int, error)) {
	var moved int64
	go func() {
		buf := make([]byte, copyChunk)
		for {
			n, err := move(buf)
			atomic.AddInt64(&moved, int64(n))
			if err != nil {
				fail("after %d bytes: %v", atomic.LoadInt64(&moved), err)
			}
		}
	}()
	done := make(chan struct{})
	go func() {
		io.Copy(ioutil.Discard, os.Stdin)
		close(done)
	}()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-done:
			c.drop()
			return
		case <-tick.C:
			report(map[string]int64{"bytes": atomic.LoadInt64(&moved)})
		}
	}
}

func download(ctx context.Context, t *transport, addr string, n int, seed int64) {
	c, err := t.dial(ctx, addr)
	if err != nil {
		fail("dial %s: %v", addr, err)
	}
	if n == 0 {
		endless(c, c.Read)
		return
	}
	start := time.Now()
	got := make([]byte, n)
	if _, err := io.ReadFull(c, got); err != nil {
		fail("reading %d bytes: %v", n, err)
	}
	seconds := time.Since(start).Seconds()
	if seed >= 0 && string(got) != string(pattern(n, uint64(seed))) {
		fail("the %d bytes read are not pattern(%d, %d)", n, n, seed)
	}
	c.drop()
	report(map[string]interface{}{"bytes": n, "seconds": seconds, "fnv": fnv(got)})
}

func upload(ctx context.Context, t *transport, addr string, n int, hash bool) {
	c, err := t.dial(ctx, addr)
	if err != nil {
		fail("dial %s: %v", addr, err)
	}
	if n == 0 {
		endless(c, c.Write)
		return
	}
	body := pattern(n, 11)
	start := time.Now()
	if hash {
		var length [8]byte
		binary.BigEndian.PutUint64(length[:], uint64(n))
		if _, err := c.Write(length[:]); err != nil {
			fail("writing the length: %v", err)
		}
	}
	if err := c.writeAll(body); err != nil {
		fail("writing %d bytes: %v", n, err)
	}
	result := map[string]interface{}{"bytes": n, "fnv": fnv(body)}
	if hash {
		var answer [8]byte
		if _, err := io.ReadFull(c, answer[:]); err != nil {
			fail("reading the hash: %v", err)
		}
		result["answer"] = binary.BigEndian.Uint64(answer[:])
		result["seconds"] = time.Since(start).Seconds()
		c.Close()
	} else {
		if err := c.Close(); err != nil {
			fail("closing: %v", err)
		}
		result["seconds"] = time.Since(start).Seconds()
	}
	report(result)
}

func echo(ctx context.Context, t *transport, addr string, n int) {
	c, err := t.dial(ctx, addr)
	if err != nil {
		fail("dial %s: %v", addr, err)
	}
	sent := pattern(n, 5)
	errs := make(chan error, 1)
	go func() {
		errs <- c.writeAll(sent)
	}()
	got := make([]byte, n)
	if _, err := io.ReadFull(c, got); err != nil {
		fail("reading the echo: %v", err)
	}
	if err := <-errs; err != nil {
		fail("writing: %v", err)
	}
	if string(got) != string(sent) {
		fail("the echo differs")
	}
	if err := c.Close(); err != nil {
		fail("closing: %v", err)
	}
	report(map[string]interface{}{"bytes": n, "fnv": fnv(got)})
}

// dials runs single-use tunnels: dial, send exchange bytes, read as many,
// close; concurrency at once, count in all or for duration.
func dials(t *transport, addr string, concurrency, count int, duration time.Duration, exchange int, limit time.Duration) {
	var mu sync.Mutex
	var latencies []time.Duration
	var failures, overLimit int
	var firstError string
	start := time.Now()
	deadline := start.Add(duration)
	next := 0
	take := func() bool {
		mu.Lock()
		defer mu.Unlock()
		if count > 0 {
			next++
			return next <= count
		}
		return time.Now().Before(deadline)
	}
	sent := pattern(exchange, 3)
	var wg sync.WaitGroup
	for w := 0; w < concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got := make([]byte, exchange)
			for take() {
				began := time.Now()
				err := boundedSingleUse(t, addr, sent, got, limit)
				took := time.Since(began)
				mu.Lock()
				if err == errOverLimit {
					overLimit++
				}
				if err != nil {
					failures++
					if firstError == "" {
						firstError = err.Error()
					}
				} else {
					latencies = append(latencies, took)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	seconds := time.Since(start).Seconds()
	sort.Slice(latencies, func(i, j int) bool { return latencies[i] < latencies[j] })
	quantile := func(q float64) float64 {
		if len(latencies) == 0 {
			return 0
		}
		i := int(q * float64(len(latencies)-1))
		return float64(latencies[i].Microseconds())
	}
	report(map[string]interface{}{
		"dials": len(latencies), "errors": failures, "first_error": firstError, "over_limit": overLimit,
		"seconds": seconds, "p50_us": quantile(0.5), "p99_us": quantile(0.99),
	})
}

// boundedSingleUse is singleUse given up on after limit (errOverLimit;
// its goroutine is left behind), or unbounded when limit is 0. got is
// used only by a tunnel that ends in time.
func boundedSingleUse(t *transport, addr string, sent, got []byte, limit time.Duration) error {
	if limit <= 0 {
		return singleUse(t, addr, sent, got, nil)
	}
	own := make([]byte, len(got))
	done := make(chan error, 1)
	go func() { done <- singleUse(t, addr, sent, own, nil) }()
	select {
	case err := <-done:
		return err
	case <-time.After(limit):
		return errOverLimit
	}
}

// stallBulk opens a tunnel to stall and never reads it, then beside it
// reads n bytes from addr, checked against pattern(n, seed).
func stallBulk(ctx context.Context, t *transport, stall, addr string, n int, seed int64) {
	stalled, err := t.dial(ctx, stall)
	if err != nil {
		fail("dial %s: %v", stall, err)
	}
	defer stalled.drop()
	download(ctx, t, addr, n, seed)
}

// singleUse runs one single-use tunnel to addr (an echo destination): a
// dial within 10 s, sent written and read back into got (checked), then
// CLOSE_REQ and CLOSE_RSP; on a failure the tunnel is dropped. dialed, when
// not nil, is called once DIAL_RSP came.
func singleUse(t *transport, addr string, sent, got []byte, dialed func()) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := t.dial(ctx, addr)
	if err != nil {
		return err
	}
	if dialed != nil {
		dialed()
	}
	if err := roundTrip(c, sent, got); err != nil {
		c.drop()
		return err
	}
	return c.Close()
}

// roundTrip writes sent on c and reads as many bytes back into got, which
// must match them.
func roundTrip(c *conn, sent, got []byte) error {
	if _, err := c.Write(sent); err != nil {
		return err
	}
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if string(got) != string(sent) {
		return errors.New("the echo differs")
	}
	return nil
}

// echoOnce writes 1 KiB on c and reads it back.
func echoOnce(c *conn, seed uint64) error {
	sent := pattern(1024, seed)
	return roundTrip(c, sent, make([]byte, len(sent)))
}

// openEchoed opens n tunnels to addr, 64 at a time, each echoing 1 KiB.
func openEchoed(ctx context.Context, t *transport, addr string, n int) []*conn {
	conns := make([]*conn, n)
	var wg sync.WaitGroup
	work := make(chan int)
	var failed int64
	var first atomic.Value
	for w := 0; w < 64; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				c, err := t.dial(ctx, addr)
				if err == nil {
					err = echoOnce(c, uint64(i))
				}
				if err != nil {
					if atomic.AddInt64(&failed, 1) == 1 {
						first.Store(err.Error())
					}
					continue
				}
				conns[i] = c
			}
		}()
	}
	for i := 0; i < n; i++ {
		work <- i
	}
	close(work)
	wg.Wait()
	if failed > 0 {
		fail("%d of %d tunnels failed; the first: %v", failed, n, first.Load())
	}
	return conns
}

// many holds n echoed tunnels (and one stalled one) open until stdin
// closes, then echoes on each again and closes them.
func many(ctx context.Context, t *transport, addr, stall string, n int) {
	if stall != "" {
		stalled, err := t.dial(ctx, stall)
		if err != nil {
			fail("dial %s: %v", stall, err)
		}
		defer stalled.drop()
	}
	conns := openEchoed(ctx, t, addr, n)
	report(map[string]int{"open": n})
	io.Copy(ioutil.Discard, os.Stdin)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i, c := range conns {
		wg.Add(1)
		go func(i int, c *conn) {
			defer wg.Done()
			if err := echoOnce(c, uint64(n+i)); err != nil {
				errs <- fmt.Errorf("tunnel %d: %v", i, err)
				return
			}
			if err := c.Close(); err != nil {
				errs <- fmt.Errorf("closing tunnel %d: %v", i, err)
			}
		}(i, c)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		fail("%v", err)
	}
	// Exit 0 says it: stdout was read up to the first line only.
}

// cut opens n echoed tunnels on the shared connection, closes the gRPC
// connection under them, and checks that every stream fails.
func cut(ctx context.Context, t *transport, addr string, n int) {
	if !t.reuse {
		fail("cut needs -reuse")
	}
	conns := openEchoed(ctx, t, addr, n)
	t.shared.Close()
	failed := 0
	for _, c := range conns {
		var pkt packet
		if err := c.stream.RecvMsg(&pkt); err != nil {
			failed++
		}
	}
	if failed != n {
		fail("%d of %d streams failed when their connection closed", failed, n)
	}
	report(map[string]int{"streams": n, "failed": failed})
}
