// A key-value store as a servlet on embedded Tomcat, for tests/tomcat.rs:
// PUT stores the body under the key the servlet sees, GET returns it, DELETE
// removes it, a missing key is 404. The key is what a servlet application
// would use: getServletPath() + getPathInfo(), after Tomcat has dropped
// ";parameters" from each segment and resolved dot segments.
//
//   javac -cp "$TOMCAT_JARS" -d OUT KvStore.java
//   java -cp "$TOMCAT_JARS:OUT" KvStore PORT BASE_DIR

import java.io.IOException;
import java.util.concurrent.ConcurrentHashMap;

import jakarta.servlet.http.HttpServlet;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.http.HttpServletResponse;
import org.apache.catalina.Context;
import org.apache.catalina.LifecycleState;
import org.apache.catalina.connector.Connector;
import org.apache.catalina.startup.Tomcat;

public class KvStore {
    static final ConcurrentHashMap<String, byte[]> VALUES = new ConcurrentHashMap<>();

    static class Kv extends HttpServlet {
        static String key(HttpServletRequest req) {
            String info = req.getPathInfo();
            return req.getServletPath() + (info == null ? "" : info);
        }

        @Override
        protected void doGet(HttpServletRequest req, HttpServletResponse res) throws IOException {
            byte[] value = VALUES.get(key(req));
            if (value == null) {
                res.sendError(404);
                return;
            }
            res.getOutputStream().write(value);
        }

        @Override
        protected void doPut(HttpServletRequest req, HttpServletResponse res) throws IOException {
            byte[] value = req.getInputStream().readAllBytes();
            res.setStatus(VALUES.put(key(req), value) == null ? 201 : 204);
        }

        @Override
        protected void doDelete(HttpServletRequest req, HttpServletResponse res) {
            res.setStatus(VALUES.remove(key(req)) == null ? 404 : 204);
        }
    }

    public static void main(String[] args) throws Exception {
        Tomcat tomcat = new Tomcat();
        tomcat.setBaseDir(args[1]);
        Connector connector = tomcat.getConnector();
        connector.setPort(Integer.parseInt(args[0]));
        connector.setProperty("address", "127.0.0.1");
        Context ctx = tomcat.addContext("", null);
        Tomcat.addServlet(ctx, "kv", new Kv());
        ctx.addServletMappingDecoded("/*", "kv");
        tomcat.start();
        if (connector.getState() != LifecycleState.STARTED) {
            // What the test harness looks for to start again on another port.
            System.out.println("Address already in use (or the connector did not start)");
            System.exit(3);
        }
        System.out.println("listening on 127.0.0.1:" + args[0]);
        tomcat.getServer().await();
    }
}
