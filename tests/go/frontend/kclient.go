package main

// The -kclient dispatch: packets are handled the way kube-apiserver's
// konnectivity-client (sigs.k8s.io/apiserver-network-proxy/konnectivity-client,
// pkg/client: grpcTunnel.serve and conn) handles them, written down here
// from its behaviour, not from its code:
//
//   - a goroutine per Proxy stream receives every packet;
//   - a successful DIAL_RSP is handed to the dialing goroutine over an
//     unbuffered channel, and it is the dialing goroutine that registers
//     the connection afterwards, while the receiving goroutine goes on to
//     the next packet;
//   - DATA or CLOSE_RSP for a connection not registered (yet) is dropped
//     ("Connection not recognized"), and receiving goes on;
//   - a CLOSE_RSP for a registered connection ends its reads and the
//     stream's receiving; so does the stream's end for the connections
//     registered by then;
//   - Read waits for the connection's DATA or its end and nothing else:
//     not for the stream's end once that has passed.
//
// One difference, so that a test can tell a cut from a clean end: where
// konnectivity-client's Read says only EOF (its Close returns the
// CLOSE_RSP's error), this Read returns the CLOSE_RSP's error, or the
// stream's, when there was one.
//
// So a CLOSE_RSP that reaches the receiving goroutine right behind its
// DIAL_RSP, before the dialing goroutine registered the connection, is
// lost, and a Read then waits forever: what an agent that dies right after
// answering a dial did to kube-apiserver's requests (issue 50). The server
// must not let that happen; this model lets the tests see whether it does.

import (
	"context"
	"errors"
	"sync"
	"time"
)

// kcCloseTimeout is how long Close waits for CLOSE_RSP after CLOSE_REQ,
// as konnectivity-client's CloseTimeout.
const kcCloseTimeout = 10 * time.Second

// kcDialResult is a DIAL_RSP handed to the dialing goroutine.
type kcDialResult struct {
	connID  int64
	errText string
}

// kcStream is the receiving side of one Proxy stream.
type kcStream struct {
	mu      sync.Mutex
	pending map[int64]chan kcDialResult
	conns   map[int64]*kcConn
	done    chan struct{}
	// Dropped counts packets for connections not registered.
	dropped int
}

// kcConn is a registered connection's receiving side.
type kcConn struct {
	readCh  chan []byte
	closeCh chan string
}

// kcStart starts receiving on c's stream.
func kcStart(c *conn) *kcStream {
	s := &kcStream{
		pending: map[int64]chan kcDialResult{},
		conns:   map[int64]*kcConn{},
		done:    make(chan struct{}),
	}
	go s.serve(c)
	return s
}

// serve receives until the stream ends or a registered connection's
// CLOSE_RSP (or a DIAL_RSP error) came.
func (s *kcStream) serve(c *conn) {
	defer func() {
		// Connections still registered never got their CLOSE_RSP.
		s.mu.Lock()
		for id, kc := range s.conns {
			kc.closeCh <- "the Proxy stream ended"
			close(kc.readCh)
			close(kc.closeCh)
			delete(s.conns, id)
		}
		s.mu.Unlock()
		close(s.done)
	}()
	for {
		var pkt packet
		if err := c.stream.RecvMsg(&pkt); err != nil {
			return
		}
		switch pkt.typ {
		case dialRsp:
			s.mu.Lock()
			ch, ok := s.pending[pkt.random]
			s.mu.Unlock()
			if !ok {
				return
			}
			// Unbuffered: handed over once the dialer takes it; the
			// dialer registers the connection after.
			ch <- kcDialResult{connID: pkt.connID, errText: pkt.errText}
			if pkt.errText != "" {
				return
			}
		case dialCls:
			s.mu.Lock()
			ch, ok := s.pending[pkt.random]
			s.mu.Unlock()
			if ok {
				ch <- kcDialResult{errText: "dial closed"}
			}
			return
		case data:
			s.mu.Lock()
			kc, ok := s.conns[pkt.connID]
			if !ok {
				s.dropped++
			}
			s.mu.Unlock()
			if !ok {
				continue
			}
			select {
			case kc.readCh <- pkt.data:
			case <-time.After(10 * time.Second):
				return
			}
		case closeRsp:
			s.mu.Lock()
			kc, ok := s.conns[pkt.connID]
			if ok {
				delete(s.conns, pkt.connID)
			} else {
				s.dropped++
			}
			s.mu.Unlock()
			if !ok {
				continue
			}
			kc.closeCh <- pkt.errText
			close(kc.readCh)
			close(kc.closeCh)
			return
		}
	}
}

// dial sends DIAL_REQ random and waits for its answer (or ctx); on success
// the connection is registered, as the dialing goroutine does.
func (s *kcStream) dial(ctx context.Context, c *conn, address string, random int64) error {
	ch := make(chan kcDialResult)
	s.mu.Lock()
	s.pending[random] = ch
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.pending, random)
		s.mu.Unlock()
	}()
	if err := c.stream.SendMsg(&packet{typ: dialReq, protocol: "tcp", address: address, random: random}); err != nil {
		return err
	}
	select {
	case res := <-ch:
		if res.errText != "" {
			return dialError(res.errText)
		}
		c.id = res.connID
		kc := &kcConn{readCh: make(chan []byte, 10), closeCh: make(chan string, 1)}
		s.mu.Lock()
		s.conns[res.connID] = kc
		s.mu.Unlock()
		c.kc = kc
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-s.done:
		return errors.New("tunnel closed")
	}
}

// read returns the connection's next DATA; once its reads ended, its
// CLOSE_RSP's error (or the stream's end) if it had one, else EOF.
func (kc *kcConn) read(c *conn, p []byte) (int, error) {
	if len(c.pending) == 0 {
		b, ok := <-kc.readCh
		if !ok {
			select {
			case text, ok := <-kc.closeCh:
				if ok && text != "" {
					return 0, errors.New("CLOSE_RSP: " + text)
				}
			default:
			}
			return 0, errEOF
		}
		c.pending = b
	}
	n := copy(p, c.pending)
	c.pending = c.pending[n:]
	return n, nil
}

// close sends CLOSE_REQ and waits for the CLOSE_RSP, the stream's end or
// kcCloseTimeout.
func (kc *kcConn) close(c *conn, s *kcStream) error {
	if err := c.stream.SendMsg(&packet{typ: closeReq, connID: c.id}); err != nil {
		return err
	}
	select {
	case text, ok := <-kc.closeCh:
		if ok && text != "" {
			return errors.New("CLOSE_RSP: " + text)
		}
		return nil
	case <-s.done:
		return errors.New("tunnel closed")
	case <-time.After(kcCloseTimeout):
		return errors.New("close timeout")
	}
}
