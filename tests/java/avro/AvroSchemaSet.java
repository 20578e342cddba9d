// Loads .avsc files with Apache Avro Java and prints the fingerprint of each schema
// (tests/unit/wire/test_avro_schema_set.py runs it through tests/avro_java.py).
//
// Each line of standard input is one job: a mode, then file paths, separated by tabs.
//   set   one org.apache.avro.SchemaParser reads every file in the order given, then
//         resolves each (a file may name types that a later file defines): how a tool
//         loads a folder of schemas as a set (Avro 1.12's parser, avro-maven-plugin).
//   each  every file read alone by a new Schema.Parser (self-contained files).
// Each job prints one line: "ok", then a tab and <full name>=<fingerprint> for each file
// in the order given (SchemaNormalization.parsingFingerprint64, a signed long); or
// "error", a tab and the exception that stopped it.

import java.io.BufferedReader;
import java.io.File;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.SchemaParser;

public final class AvroSchemaSet {
  private AvroSchemaSet() {}

  private static List<Schema> loadSet(List<File> files) throws Exception {
    SchemaParser parser = new SchemaParser();
    List<SchemaParser.ParseResult> parsed = new ArrayList<>();
    for (File file : files) {
      parsed.add(parser.parse(file));
    }
    List<Schema> schemas = new ArrayList<>();
    for (SchemaParser.ParseResult result : parsed) {
      schemas.add(parser.resolve(result));
    }
    return schemas;
  }

  private static List<Schema> loadEach(List<File> files) throws Exception {
    List<Schema> schemas = new ArrayList<>();
    for (File file : files) {
      schemas.add(new Schema.Parser().parse(file));
    }
    return schemas;
  }

  private static String job(String line) {
    String[] parts = line.split("\t");
    List<File> files = new ArrayList<>();
    for (int i = 1; i < parts.length; i++) {
      files.add(new File(parts[i]));
    }
    StringBuilder out = new StringBuilder("ok");
    try {
      List<Schema> schemas;
      if (parts[0].equals("set")) {
        schemas = loadSet(files);
      } else if (parts[0].equals("each")) {
        schemas = loadEach(files);
      } else {
        return "error\tunknown mode " + parts[0];
      }
      for (Schema schema : schemas) {
        out.append('\t').append(schema.getFullName()).append('=')
            .append(SchemaNormalization.parsingFingerprint64(schema));
      }
    } catch (Exception e) {
      return "error\t" + (e.getClass().getName() + ": " + e.getMessage()).replaceAll("\\s+", " ");
    }
    return out.toString();
  }

  public static void main(String[] args) throws Exception {
    BufferedReader in =
        new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
    String line;
    while ((line = in.readLine()) != null) {
      if (!line.isEmpty()) {
        System.out.println(job(line));
      }
    }
  }
}
